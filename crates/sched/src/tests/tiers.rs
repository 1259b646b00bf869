//! Preemption, tier shares and per-tenant fair share.

use std::time::Duration;

use super::{End, Sim};
use crate::config::tests::two_tiers;

#[test]
fn preemption_takes_lowest_tier_youngest_first_and_loses_nothing() {
    // 10 blocks of 4 tokens; three sequences that each grow to 5-7 blocks.
    let mut c = two_tiers(10, 4);
    c.queue_timeout = Duration::from_secs(1);
    let mut sim = Sim::new(c);
    // Steps of 200 ms: a preempted request waits well past its queue
    // timeout, and must not expire (it has already streamed tokens).
    sim.tick = Duration::from_millis(100);
    let f1 = sim.submit(0, 8, 20).unwrap();
    let f2 = sim.submit(1, 8, 20).unwrap();
    let p = sim.submit(2, 8, 12).unwrap();
    let first = sim.step();
    // Ties in fair share go to the more protected tier.
    let order: Vec<_> = first.items.iter().map(|i| i.id).collect();
    assert_eq!(order, [p, f1, f2]);
    sim.run_until_idle(300);
    assert!(!sim.preempt_log.is_empty(), "the pool was meant to run out");
    assert_eq!(sim.preempt_log[0], f2, "youngest of the lowest tier first");
    assert_eq!(sim.reqs[&p].preempted, 0, "never the paid sequence");
    assert!(sim.s.counters().preemptions >= 1);
    assert_eq!(sim.s.status().preemptions, sim.preempt_log.len() as u64);
    for id in [f1, f2, p] {
        assert!(
            matches!(sim.reqs[&id].end, Some(End::Finished(..))),
            "{id}: {:?}",
            sim.reqs[&id].end
        );
    }
    // Tokens equal running alone: no duplicate, no loss across preemption.
    sim.assert_all_done();
}

#[test]
fn paid_trickle_is_admitted_promptly_through_a_free_flood() {
    let mut c = two_tiers(512, 16);
    c.max_num_seqs = 4;
    c.max_num_batched_tokens = 64;
    let mut sim = Sim::new(c);
    for _ in 0..40 {
        sim.submit(0, 16, 24).unwrap();
    }
    let mut paid = Vec::new();
    for round in 0..60 {
        if round % 5 == 0 && paid.len() < 10 {
            paid.push(sim.submit(2, 16, 8).unwrap());
        }
        sim.step();
    }
    for id in &paid {
        let t = &sim.reqs[id];
        let waited = t.first_planned_step.expect("paid request admitted") - t.submitted_step;
        assert!(waited <= 2, "{id} waited {waited} steps");
    }
    // Free keeps its share meanwhile.
    assert!(
        sim.tenant_tokens(0) >= 60,
        "free got {} tokens",
        sim.tenant_tokens(0)
    );
    sim.run_until_idle(2000);
    sim.assert_all_done();
}

#[test]
fn free_keeps_its_share_under_a_paid_flood() {
    let mut c = two_tiers(512, 16);
    c.max_num_seqs = 4;
    c.max_num_batched_tokens = 64;
    let mut sim = Sim::new(c);
    for _ in 0..40 {
        sim.submit(2, 16, 24).unwrap();
        sim.submit(0, 16, 24).unwrap();
    }
    let mut last_free = (0, sim.tenant_tokens(0));
    for step in 0..150 {
        sim.step();
        // Free never starves: it gets tokens every few steps.
        if sim.tenant_tokens(0) > last_free.1 {
            last_free = (step, sim.tenant_tokens(0));
        }
        assert!(step - last_free.0 <= 10, "free got nothing for 10 steps");
    }
    let (free, paid) = (sim.tenant_tokens(0), sim.tenant_tokens(2));
    let share = free as f64 / (free + paid) as f64;
    // Weights 1:3 of seats and tokens.
    assert!(
        (0.15..=0.4).contains(&share),
        "free share {share:.2} ({free} vs {paid})"
    );
    sim.run_until_idle(3000);
    sim.assert_all_done();
}

#[test]
fn vtc_gives_heavy_and_light_tenants_comparable_service() {
    let mut c = two_tiers(512, 16);
    c.max_num_seqs = 2;
    c.max_num_batched_tokens = 64;
    let mut sim = Sim::new(c);
    // The heavy tenant queues 30 first; FIFO would serve none of b's 30 until then.
    for _ in 0..30 {
        sim.submit(0, 16, 16).unwrap();
    }
    for _ in 0..30 {
        sim.submit(1, 16, 16).unwrap();
    }
    for _ in 0..200 {
        sim.step();
    }
    let (a, b) = (sim.tenant_tokens(0), sim.tenant_tokens(1));
    assert!(a.abs_diff(b) <= 32, "a {a} vs b {b}");
    assert!(b >= 100);
    sim.run_until_idle(2000);
    sim.assert_all_done();
}

#[test]
fn vtc_weights_and_lift_of_a_returning_tenant() {
    let mut c = two_tiers(512, 16);
    c.max_num_seqs = 3;
    c.max_num_batched_tokens = 64;
    c.tenants[1].weight = 2;
    let mut sim = Sim::new(c);
    // Tenant a is served alone for a long time...
    for _ in 0..60 {
        sim.submit(0, 16, 16).unwrap();
    }
    for _ in 0..150 {
        sim.step();
    }
    // ...then b (weight 2) arrives: lifted to a's counter, it gets about
    // twice a's service, not all of it while it "catches up".
    for _ in 0..40 {
        sim.submit(1, 16, 16).unwrap();
    }
    let a0 = sim.tenant_tokens(0);
    for _ in 0..150 {
        sim.step();
    }
    let (a, b) = (sim.tenant_tokens(0) - a0, sim.tenant_tokens(1));
    let ratio = b as f64 / a as f64;
    assert!(
        (1.4..=2.8).contains(&ratio),
        "b/a = {ratio:.2} ({b} vs {a})"
    );
    sim.run_until_idle(3000);
    sim.assert_all_done();
}

#[test]
fn tier_reservation_and_quota_are_respected() {
    let mut c = two_tiers(16, 4);
    c.tiers[1].kv_reserved_blocks = 6;
    c.tenants[0].kv_blocks_max = Some(5);
    let mut sim = Sim::new(c);
    // Free may use at most 10 blocks; tenant a at most 5 (one request of 5 blocks).
    for _ in 0..6 {
        sim.submit(0, 8, 12).unwrap();
        sim.submit(1, 8, 12).unwrap();
    }
    let p = sim.submit(2, 12, 12).unwrap();
    for _ in 0..400 {
        if sim.s.is_idle() {
            break;
        }
        sim.step();
        let pool = &mut sim.s.pool;
        assert!(pool.tenant_blocks(0) <= 5);
        let (free, paid) = (
            pool.tenant_blocks(0) + pool.tenant_blocks(1),
            pool.tenant_blocks(2),
        );
        assert!(
            free + 6u32.saturating_sub(paid) <= 16,
            "free took paid's reserve"
        );
    }
    assert!(matches!(sim.reqs[&p].end, Some(End::Finished(..))));
    assert_eq!(sim.reqs[&p].preempted, 0);
    sim.assert_all_done();
}

#[test]
fn preempted_free_request_gets_back_in_under_steady_paid_load() {
    // 16 blocks of 4 tokens: the free request grows to 12 blocks, each paid
    // one to 6, so paid decodes growing preempt it again and again, and
    // every block that frees is wanted by the paid queue.
    let mut c = two_tiers(16, 4);
    c.max_num_batched_tokens = 64;
    let mut sim = Sim::new(c);
    let f = sim.submit(0, 8, 40).unwrap();
    let mut steps = 0;
    while sim.reqs[&f].end.is_none() {
        // Paid load at KV capacity: always two paid requests queued.
        let queued_paid = sim.s.status().tiers[1].queued;
        for _ in queued_paid..2 {
            sim.submit(2, 8, 16).unwrap();
        }
        sim.step();
        steps += 1;
        assert!(
            steps <= 400,
            "free request starved: {} tokens after {steps} steps, preempted {} times",
            sim.reqs[&f].out.len(),
            sim.reqs[&f].preempted
        );
    }
    assert!(
        sim.reqs[&f].preempted > 0,
        "the free request was meant to be preempted"
    );
    assert!(matches!(sim.reqs[&f].end, Some(End::Finished(..))));
    sim.run_until_idle(1000);
    sim.assert_all_done();
}

#[test]
fn no_victim_is_preempted_for_a_newcomer_that_cannot_fit() {
    // 16 blocks of 4 tokens, 3 seats: a paid request of 11 blocks and two
    // free ones of 2 blocks each fill every seat and all but one block.
    let mut c = two_tiers(16, 4);
    c.max_num_seqs = 3;
    let mut sim = Sim::new(c);
    let p1 = sim.submit(2, 40, 8).unwrap();
    let a = sim.submit(0, 4, 40).unwrap();
    let b = sim.submit(1, 4, 40).unwrap();
    sim.step();
    sim.step();
    assert_eq!(sim.s.num_running(), 3);
    // A paid newcomer of 8 blocks: free holds more than its share of seats,
    // but the free blocks plus both free sequences' 4 could never hold it.
    let p2 = sim.submit(2, 32, 4).unwrap();
    for _ in 0..3 {
        sim.step();
    }
    assert!(
        sim.preempt_log.is_empty(),
        "preempted for nothing: {:?}",
        sim.preempt_log
    );
    assert!(sim.reqs[&p2].first_planned_step.is_none());
    sim.run_until_idle(500);
    for id in [p1, a, b, p2] {
        assert!(matches!(sim.reqs[&id].end, Some(End::Finished(..))), "{id}");
    }
    sim.assert_all_done();
}

#[test]
fn free_prompts_get_their_share_of_a_step_while_paid_has_work() {
    // Budget 256; free weight 1, paid weight 3: while paid has work, free
    // prompts may add at most 256 * 1 / 4 = 64 tokens to a step.
    let mut sim = Sim::new(two_tiers(512, 16));
    let alone = sim.submit(0, 300, 4).unwrap();
    let p = sim.plan();
    let first = p.items.iter().find(|i| i.id == alone).unwrap().tokens.len();
    assert_eq!(
        first, 256,
        "without paid work a free prompt takes the whole budget"
    );
    sim.execute(&p);
    sim.run_until_idle(100);

    sim.submit(2, 8, 200).unwrap();
    sim.step();
    let free: Vec<_> = (0..3).map(|_| sim.submit(0, 300, 4).unwrap()).collect();
    let paid_prompt = sim.submit(2, 200, 4).unwrap();
    let mut free_tokens = 0;
    let mut paid_prompt_first = None;
    for _ in 0..12 {
        let p = sim.step();
        let free_prefill: usize = p
            .items
            .iter()
            .filter(|i| free.contains(&i.id) && i.sample.is_none())
            .map(|i| i.tokens.len())
            .sum();
        assert!(
            free_prefill <= 64,
            "free prompts took {free_prefill} tokens of one step"
        );
        free_tokens += free_prefill;
        if let Some(i) = p.items.iter().find(|i| i.id == paid_prompt) {
            paid_prompt_first.get_or_insert(i.tokens.len());
        }
    }
    assert!(free_tokens > 0, "free prompts made no progress");
    assert_eq!(
        paid_prompt_first,
        Some(200),
        "a paid prompt is not capped by the free tier's share"
    );
    sim.run_until_idle(3000);
    sim.assert_all_done();
}

/// The same preemption with an offload tier: the preempted sequence's
/// blocks are cached when it is preempted, spill when the others take them,
/// and are restored when it comes back (the model checks their contents at
/// every step), so it recomputes only its last partial block; without the
/// tier it recomputes everything it had.
#[test]
fn preempted_sequences_come_back_through_the_offload_tier() {
    let run = |offload_blocks: u32| {
        let mut c = two_tiers(10, 4);
        c.offload_blocks = offload_blocks;
        let mut sim = Sim::new(c);
        sim.tick = Duration::from_millis(100);
        let ids = [
            sim.submit(0, 8, 20).unwrap(),
            sim.submit(1, 8, 20).unwrap(),
            sim.submit(2, 8, 12).unwrap(),
        ];
        sim.run_until_idle(300);
        assert!(!sim.preempt_log.is_empty(), "the pool was meant to run out");
        sim.assert_all_done();
        let computed: usize = ids.iter().map(|id| sim.reqs[id].computed).sum();
        (computed, sim.s.offload_stats())
    };
    let (recomputed, none) = run(0);
    let (restored, tier) = run(16);
    assert_eq!(none, flotilla_kv::OffloadStats::default());
    assert!(tier.spilled > 0 && tier.restored > 0, "{tier:?}");
    // Work: 8 + 20 (less the last sample) per request, plus what
    // preemption made it compute again.
    assert!(
        restored < recomputed,
        "{restored} tokens computed with the tier, {recomputed} without"
    );
}

/// A paid tier's latency budget (`step_tokens_max`): while paid work runs,
/// each step holds every paid decode and at most the budget in all, the
/// free decodes taking turns (none starves, none is dropped); without paid
/// work the free sequences fill the step again. Output is the same tokens
/// as without the budget.
#[test]
fn a_latency_budget_keeps_paid_steps_small_and_free_decodes_take_turns() {
    let mut c = two_tiers(1024, 16);
    c.max_num_seqs = 16;
    c.tiers[1].step_tokens_max = Some(4);
    let mut sim = Sim::new(c);
    let free: Vec<_> = (0..8).map(|i| sim.submit(i % 2, 8, 40).unwrap()).collect();
    // The free prompts, then free decodes alone: everything fits.
    for _ in 0..3 {
        sim.step();
    }
    let plan = sim.step();
    assert_eq!(plan.items.len(), 8, "no paid work: a full step");
    let paid = sim.submit(2, 8, 30).unwrap();
    let mut free_turns = std::collections::BTreeMap::<_, usize>::new();
    let mut paid_steps = 0;
    for _ in 0..24 {
        let plan = sim.step();
        let has_paid = plan.items.iter().any(|i| i.id == paid);
        if !has_paid {
            continue;
        }
        paid_steps += 1;
        let paid_tokens: usize = plan
            .items
            .iter()
            .filter(|i| i.id == paid)
            .map(|i| i.tokens.len())
            .sum();
        let free_tokens: usize = plan.num_tokens() - paid_tokens;
        // Free work never passes the budget; beside a running paid
        // sequence it fills the step up to the budget in all. (The step
        // that admits the paid prompt plans the running free decodes
        // first, so its prompt comes on top of them.)
        assert!(free_tokens <= 4, "{free_tokens} free tokens");
        if paid_tokens == 1 {
            assert!(
                free_tokens <= 3,
                "{free_tokens} free tokens beside a paid decode"
            );
        }
        for i in plan.items.iter().filter(|i| i.id != paid) {
            *free_turns.entry(i.id).or_default() += 1;
        }
    }
    assert!(
        paid_steps >= 20,
        "the paid request ran ({paid_steps} steps)"
    );
    // 3 free decodes a step over 8 free sequences: each got its turns.
    for id in &free {
        let n = free_turns.get(id).copied().unwrap_or(0);
        assert!(
            n >= 5,
            "{id} decoded in {n} of the paid steps: {free_turns:?}"
        );
    }
    // The paid request ends; its budget lingers (its client's next request
    // finds a short step in flight), then the free ones fill steps again.
    for _ in 0..40 {
        if sim.reqs[&paid].end.is_some() {
            break;
        }
        sim.step();
    }
    assert!(sim.reqs[&paid].end.is_some(), "the paid request finished");
    let lingering = sim.step();
    assert!(
        lingering.items.len() <= 4,
        "{} items",
        lingering.items.len()
    );
    sim.now += crate::PROTECT_LINGER;
    let full = sim.step();
    assert_eq!(full.items.len(), 8, "the budget has lapsed");
    sim.run_until_idle(400);
    sim.assert_all_done();
}

/// The same budget as a time (`step_time_max`): turned into tokens by the
/// step cost measured so far (here 2 ms + 0.5 ms per token, so 4.5 ms is 5
/// tokens), none before anything is measured; it follows the machine.
#[test]
fn a_latency_budget_in_time_follows_the_measured_step_cost() {
    let mut c = two_tiers(1024, 16);
    c.max_num_seqs = 16;
    c.tiers[1].step_time_max = Some(Duration::from_micros(4500));
    let mut sim = Sim::new(c);
    let mut per_token_us = 500;
    let step = |sim: &mut Sim, per_token_us: u64| {
        sim.step_cost_us = (2000, per_token_us);
        sim.step()
    };
    for i in 0..8 {
        sim.submit(i % 2, 8, 60).unwrap();
    }
    let paid = sim.submit(2, 8, 40).unwrap();
    // Unmeasured: no budget yet, everyone's prompt in the first step.
    assert_eq!(step(&mut sim, per_token_us).num_tokens(), 9 * 8);
    let free_beside_paid = |p: &crate::Plan| {
        assert!(p.items.iter().any(|i| i.id == paid && i.tokens.len() == 1));
        p.num_tokens() - 1
    };
    for _ in 0..3 {
        step(&mut sim, per_token_us);
    }
    for _ in 0..10 {
        let p = step(&mut sim, per_token_us);
        assert_eq!(free_beside_paid(&p), 4, "5 tokens in all");
    }
    // The machine slows down fivefold per token: the budget shrinks to
    // (4.5 - 2) / 2.5 = 1 token, the paid decode alone (free work gets
    // nothing while paid work runs within its budget).
    per_token_us = 2500;
    let mut last = usize::MAX;
    for _ in 0..20 {
        let p = step(&mut sim, per_token_us);
        last = free_beside_paid(&p);
    }
    assert_eq!(last, 0);
    sim.run_until_idle(1000);
    sim.assert_all_done();
}

#[test]
fn a_zero_latency_budget_is_refused() {
    let mut c = two_tiers(64, 16);
    c.tiers[1].step_tokens_max = Some(0);
    let e = c.validate().unwrap_err().to_string();
    assert!(e.contains("step_tokens_max"), "{e}");
}
