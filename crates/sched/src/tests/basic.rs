//! Batching, chunked prefill, admission, expiry, cancel, prefix cache, stop.

use std::time::Duration;

use flotilla_proto::{EngineFailure, FinishReason, Rejection, RequestId, TenantId};

use super::{End, Sim, tok};
use crate::config::tests::two_tiers;
use crate::{Batching, Plan};

fn ids(p: &Plan) -> Vec<RequestId> {
    p.items.iter().map(|i| i.id).collect()
}

fn item(p: &Plan, id: RequestId) -> Option<&crate::PlanItem> {
    p.items.iter().find(|i| i.id == id)
}

#[test]
fn continuous_batching_joins_and_leaves() {
    let mut c = two_tiers(256, 16);
    c.max_num_seqs = 3;
    c.max_num_batched_tokens = 32;
    let mut sim = Sim::new(c);
    let a = sim.submit(0, 10, 6).unwrap();
    let p = sim.step();
    assert_eq!(ids(&p), [a]);
    assert_eq!(p.items[0].tokens.len(), 10);
    assert!(p.items[0].sample.is_some());
    sim.step();
    // B joins while A decodes: A's one token and B's whole prompt in one step.
    let b = sim.submit(1, 20, 4).unwrap();
    let p = sim.step();
    assert_eq!(ids(&p), [a, b]);
    assert_eq!(item(&p, a).unwrap().tokens.len(), 1);
    assert_eq!(item(&p, b).unwrap().tokens.len(), 20);
    // A flood beyond the seats: never more than 3 items nor 32 tokens (the
    // harness checks both every step); A leaves when done.
    for _ in 0..6 {
        sim.submit(0, 12, 5).unwrap();
    }
    let mut seen_after_end = false;
    for _ in 0..100 {
        if sim.s.is_idle() {
            break;
        }
        let ended_before = sim.reqs[&a].end.is_some();
        let p = sim.step();
        if ended_before && ids(&p).contains(&a) {
            seen_after_end = true;
        }
        assert!(sim.s.num_running() <= 3);
    }
    assert!(!seen_after_end);
    assert!(matches!(
        sim.reqs[&a].end,
        Some(End::Finished(FinishReason::Length, ..))
    ));
    sim.assert_all_done();
}

#[test]
fn chunked_prefill_keeps_decoding() {
    let mut c = two_tiers(256, 16);
    c.max_num_batched_tokens = 64;
    let mut sim = Sim::new(c);
    let a = sim.submit(0, 8, 100).unwrap();
    sim.step();
    let b = sim.submit(1, 1000, 5).unwrap();
    let mut prefill_steps = 0;
    loop {
        let p = sim.step();
        // The decode first, every step; the long prompt gets what is left.
        assert_eq!(item(&p, a).unwrap().tokens.len(), 1);
        let bi = item(&p, b).unwrap();
        prefill_steps += 1;
        assert!(bi.tokens.len() <= 63);
        if bi.sample.is_some() {
            break;
        }
        assert_eq!(bi.tokens.len(), 63);
    }
    assert_eq!(prefill_steps, 1000usize.div_ceil(63));
    assert_eq!(sim.reqs[&b].out.len(), 1);
    sim.run_until_idle(500);
    sim.assert_all_done();
}

#[test]
fn admission_refusals() {
    let mut c = two_tiers(64, 4);
    c.max_model_len = 64;
    c.tenants[0].max_concurrent = 2;
    c.tenants[1].requests_per_minute = Some(2);
    c.tenants[2].kv_blocks_max = Some(2);
    c.tiers[1].queue_len_max = 2;
    let mut sim = Sim::new(c);
    assert_eq!(
        sim.submit(0, 60, 5),
        Err(Rejection::TooLong {
            prompt_tokens: 60,
            max_tokens: 5,
            max_model_len: 64
        })
    );
    assert!(matches!(sim.submit(0, 0, 5), Err(Rejection::Invalid(_))));
    assert!(matches!(sim.submit(0, 5, 0), Err(Rejection::Invalid(_))));
    assert!(matches!(sim.submit(9, 5, 5), Err(Rejection::Invalid(_))));
    let mut bad = Sim::request(0, vec![5; 5], 5);
    bad.sampling.temperature = -1.0;
    assert!(matches!(sim.submit_req(bad), Err(Rejection::Invalid(_))));
    // Over the tenant's 2-block quota: certain never to fit.
    match sim.submit(2, 10, 1) {
        Err(Rejection::Invalid(m)) => assert!(m.contains("KV blocks"), "{m}"),
        other => panic!("{other:?}"),
    }

    // Concurrency: queued + running.
    let a = sim.submit(0, 5, 5).unwrap();
    sim.submit(0, 5, 5).unwrap();
    assert!(matches!(
        sim.submit(0, 5, 5),
        Err(Rejection::TenantLimit {
            retry_after_s: 1,
            ..
        })
    ));
    sim.cancel(a);
    sim.submit(0, 5, 5).unwrap();

    // Rate: a burst of 2, then one every 30 s.
    sim.submit(1, 5, 5).unwrap();
    sim.submit(1, 5, 5).unwrap();
    assert!(matches!(
        sim.submit(1, 5, 5),
        Err(Rejection::TenantLimit {
            retry_after_s: 30,
            ..
        })
    ));
    sim.now += Duration::from_secs(20);
    assert!(matches!(
        sim.submit(1, 5, 5),
        Err(Rejection::TenantLimit {
            retry_after_s: 10,
            ..
        })
    ));
    sim.now += Duration::from_secs(10);
    sim.submit(1, 5, 5).unwrap();

    // Queue full (tier 1 holds 2 waiting); running ones do not count.
    sim.submit(2, 3, 2).unwrap();
    sim.submit(2, 3, 2).unwrap();
    assert!(matches!(
        sim.submit(2, 3, 2),
        Err(Rejection::QueueFull {
            queue_len_max: 2,
            ..
        })
    ));
    sim.step();
    sim.submit(2, 3, 2).unwrap();
    assert_eq!(sim.s.counters().rejected, 10);
    sim.run_until_idle(200);
    sim.assert_all_done();
}

#[test]
fn queue_timeout_fails_waiting_and_frees() {
    let mut c = two_tiers(64, 16);
    c.max_num_seqs = 1;
    c.queue_timeout = Duration::from_secs(1);
    let mut sim = Sim::new(c);
    let t0 = sim.now;
    let a = sim.submit(0, 10, 200).unwrap();
    let b = sim.submit(1, 10, 5).unwrap();
    assert_eq!(sim.s.next_deadline(), Some(t0 + Duration::from_secs(1)));
    sim.step();
    // A started: only B's deadline is left.
    assert_eq!(sim.s.next_deadline(), Some(t0 + Duration::from_secs(1)));
    while sim.reqs[&b].end.is_none() {
        sim.step();
        assert!(sim.now < t0 + Duration::from_millis(1100));
    }
    match &sim.reqs[&b].end {
        Some(End::Failed(EngineFailure::QueueTimeout {
            waited_ms,
            limit_ms: 1000,
        })) => {
            assert!(*waited_ms >= 1000)
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(sim.s.next_deadline(), None);
    assert!(
        sim.reqs[&a].end.is_none(),
        "a running request never expires"
    );
    sim.run_until_idle(500);
    sim.assert_all_done();
    assert_eq!(sim.s.counters().failed, 1);
}

#[test]
fn expire_while_a_step_is_in_flight_touches_only_the_queue() {
    let mut c = two_tiers(64, 16);
    c.max_num_seqs = 1;
    c.queue_timeout = Duration::from_secs(1);
    let mut sim = Sim::new(c);
    let a = sim.submit(0, 10, 5).unwrap();
    let b = sim.submit(1, 10, 5).unwrap();
    let plan = sim.plan();
    assert_eq!(ids(&plan), [a]);
    // The step takes longer than B may wait: the shell expires it meanwhile.
    sim.now += Duration::from_secs(2);
    let now = sim.now;
    sim.s.expire(now);
    sim.collect();
    sim.check();
    assert!(matches!(
        sim.reqs[&b].end,
        Some(End::Failed(EngineFailure::QueueTimeout { .. }))
    ));
    assert_eq!(sim.s.next_deadline(), None);
    sim.execute(&plan);
    sim.run_until_idle(20);
    assert!(matches!(sim.reqs[&a].end, Some(End::Finished(..))));
    sim.assert_all_done();
}

#[test]
fn fail_all_ends_every_request_and_abandons_the_step() {
    let mut c = two_tiers(64, 16);
    c.max_num_seqs = 2;
    let mut sim = Sim::new(c);
    let a = sim.submit(0, 10, 5).unwrap();
    let p = sim.submit(2, 10, 5).unwrap();
    let queued = sim.submit(1, 10, 5).unwrap();
    let plan = sim.plan();
    assert_eq!(plan.items.len(), 2);
    // The worker died with the step: its results never come.
    let now = sim.now;
    let why = EngineFailure::Internal("worker gone".into());
    sim.s.fail_all(now, why.clone());
    sim.collect();
    sim.check();
    for id in [a, p, queued] {
        assert_eq!(sim.reqs[&id].end, Some(End::Failed(why.clone())), "{id}");
    }
    assert!(sim.s.is_idle());
    assert_eq!(sim.s.next_deadline(), None);
    sim.assert_all_done();
    // Nothing is in flight any more: scheduling works again.
    sim.s.fail_all(now, EngineFailure::ShuttingDown);
    let b = sim.submit(0, 10, 3).unwrap();
    sim.run_until_idle(20);
    assert!(matches!(sim.reqs[&b].end, Some(End::Finished(..))));
    sim.assert_all_done();
}

#[test]
fn huge_queue_timeout_saturates() {
    let mut c = two_tiers(64, 16);
    c.queue_timeout = Duration::MAX;
    let mut sim = Sim::new(c);
    let a = sim.submit(0, 10, 3).unwrap();
    assert_eq!(sim.s.next_deadline(), Some(Duration::MAX));
    sim.run_until_idle(20);
    assert!(matches!(sim.reqs[&a].end, Some(End::Finished(..))));
    sim.assert_all_done();
}

#[test]
fn cancel_in_queue_and_in_flight_returns_blocks() {
    let mut c = two_tiers(64, 16);
    c.max_num_seqs = 1;
    let mut sim = Sim::new(c);
    let a = sim.submit(0, 40, 50).unwrap();
    let b = sim.submit(0, 40, 50).unwrap();
    sim.step();
    sim.step();
    assert!(sim.cancel(b));
    assert!(!sim.cancel(b));
    // Cancelled between schedule and complete: its results are skipped.
    let p = sim.plan();
    assert_eq!(ids(&p), [a]);
    assert!(sim.cancel(a));
    assert_eq!(sim.s.kv_usage().used, 0);
    sim.execute(&p);
    assert!(sim.s.is_idle());
    assert_eq!(sim.s.counters().cancelled, 2);
    sim.assert_all_done();
}

#[test]
fn static_batching_takes_no_joins_until_drained() {
    for batching in [Batching::Static, Batching::Continuous] {
        let mut c = two_tiers(64, 16);
        c.max_num_seqs = 2;
        c.batching = batching;
        let mut sim = Sim::new(c);
        let a = sim.submit(0, 5, 2).unwrap();
        let b = sim.submit(0, 5, 10).unwrap();
        let late = sim.submit(0, 5, 2).unwrap();
        let mut joined_while_b_ran = false;
        while sim.reqs[&late].first_planned_step.is_none() {
            sim.step();
            if sim.reqs[&late].first_planned_step.is_some() && sim.reqs[&b].end.is_none() {
                joined_while_b_ran = true;
            }
        }
        assert!(sim.reqs[&a].end.is_some());
        assert_eq!(joined_while_b_ran, batching == Batching::Continuous);
        sim.run_until_idle(100);
        sim.assert_all_done();
    }
}

#[test]
fn prefix_cache_skips_computed_blocks() {
    let mut c = two_tiers(64, 16);
    c.tenants[2].prefix_salt = 7;
    let mut sim = Sim::new(c);
    let prompt = sim.unique_prompt(100);
    let a = sim.submit_req(Sim::request(0, prompt.clone(), 4)).unwrap();
    let p = sim.step();
    assert_eq!(item(&p, a).unwrap().tokens.len(), 100);
    sim.run_until_idle(20);
    // Same namespace: 6 full blocks reused, 4 tokens computed.
    let b = sim.submit_req(Sim::request(1, prompt.clone(), 4)).unwrap();
    let p = sim.step();
    let bi = item(&p, b).unwrap();
    assert_eq!((bi.start_pos, bi.tokens.len()), (96, 4));
    // Another salt: nothing shared.
    let c2 = sim.submit_req(Sim::request(2, prompt, 4)).unwrap();
    let p = sim.step();
    assert_eq!(item(&p, c2).unwrap().start_pos, 0);
    sim.run_until_idle(20);
    match &sim.reqs[&b].end {
        Some(End::Finished(_, usage, _)) => assert_eq!(usage.cached_tokens, 96),
        other => panic!("{other:?}"),
    }
    sim.assert_all_done();
}

#[test]
fn stop_tokens_end_and_are_emitted() {
    let mut c = two_tiers(64, 16);
    // Request 2's second token (position 11) is a model stop token; it is
    // also request 3's first (position 10).
    c.stop_tokens = vec![2, tok(RequestId(2), 11)];
    assert_eq!(tok(RequestId(2), 11), tok(RequestId(3), 10));
    let mut sim = Sim::new(c);
    let mut r = Sim::request(0, sim.unique_prompt(20), 20);
    r.stop_token_ids = vec![tok(RequestId(1), 22)];
    let a = sim.submit_req(r).unwrap();
    let b = sim.submit(0, 10, 20).unwrap();
    let mut r = Sim::request(1, sim.unique_prompt(10), 5);
    r.ignore_eos = true;
    let c3 = sim.submit_req(r).unwrap();
    assert_eq!((a, b, c3), (RequestId(1), RequestId(2), RequestId(3)));
    sim.run_until_idle(50);
    let reason = |id| match &sim.reqs[&id].end {
        Some(End::Finished(r, u, _)) => (*r, u.completion_tokens),
        other => panic!("{other:?}"),
    };
    // The stop token is counted and was emitted as a Token event.
    assert_eq!(reason(a), (FinishReason::Stop, 3));
    assert_eq!(*sim.reqs[&a].out.last().unwrap(), tok(a, 22));
    assert_eq!(reason(b), (FinishReason::Stop, 2));
    assert_eq!(reason(c3), (FinishReason::Length, 5));
    sim.assert_all_done();
}

#[test]
fn ignore_eos_ignores_model_stop_but_not_explicit() {
    let mut c = two_tiers(64, 16);
    c.stop_tokens = vec![tok(RequestId(1), 11), tok(RequestId(2), 11)];
    let mut sim = Sim::new(c);
    let mut r = Sim::request(0, sim.unique_prompt(10), 5);
    r.ignore_eos = true;
    let a = sim.submit_req(r).unwrap();
    let mut r = Sim::request(0, sim.unique_prompt(10), 5);
    r.ignore_eos = true;
    r.stop_token_ids = vec![tok(RequestId(2), 11)];
    let b = sim.submit_req(r).unwrap();
    sim.run_until_idle(50);
    assert!(matches!(
        sim.reqs[&a].end,
        Some(End::Finished(FinishReason::Length, ..))
    ));
    assert!(matches!(
        sim.reqs[&b].end,
        Some(End::Finished(FinishReason::Stop, ..))
    ));
    assert_eq!(sim.reqs[&b].out.len(), 2);
    sim.assert_all_done();
}

#[test]
fn failed_step_fails_its_requests_only() {
    let mut c = two_tiers(64, 16);
    c.max_num_seqs = 2;
    let mut sim = Sim::new(c);
    let a = sim.submit(0, 10, 5).unwrap();
    let queued = sim.submit(1, 10, 5).unwrap();
    let p2 = sim.submit(2, 10, 5).unwrap();
    let p = sim.plan();
    // Equal fair-share counters: the more protected tier first.
    assert_eq!(ids(&p), [p2, a]);
    let now = sim.now;
    sim.s.fail_step(now, &p, "device lost");
    sim.collect();
    for id in [a, p2] {
        assert_eq!(
            sim.reqs[&id].end,
            Some(End::Failed(EngineFailure::Internal("device lost".into())))
        );
    }
    assert_eq!(sim.s.kv_usage().used, 0);
    sim.run_until_idle(20);
    assert!(matches!(sim.reqs[&queued].end, Some(End::Finished(..))));
    sim.assert_all_done();
}

#[test]
fn status_reports_queues_and_kv() {
    let mut c = two_tiers(64, 16);
    c.max_num_seqs = 1;
    let mut sim = Sim::new(c);
    sim.submit(0, 20, 5).unwrap();
    sim.submit(2, 20, 5).unwrap();
    sim.step();
    let st = sim.s.status();
    assert!(st.ready);
    assert_eq!((st.steps, st.running), (1, 1));
    assert_eq!(
        st.tiers
            .iter()
            .map(|t| (t.queued, t.running))
            .collect::<Vec<_>>(),
        [(1, 0), (0, 1)]
    );
    assert_eq!(st.kv.total, 64);
    assert!(st.kv.used >= 2);
    assert_eq!(sim.s.config().tenants[2].tier.0, 1);
    let _ = TenantId(0);
    sim.run_until_idle(50);
    sim.assert_all_done();
}

#[test]
fn a_stop_string_end_finishes_with_usage_and_returns_blocks() {
    let mut sim = Sim::new(two_tiers(64, 16));
    let a = sim.submit(0, 40, 50).unwrap();
    for _ in 0..4 {
        sim.step();
    }
    // Ended by the Router between schedule and complete: finished now, the
    // step's result for it is skipped.
    let p = sim.plan();
    assert!(sim.finish_early(a));
    assert!(!sim.finish_early(a), "ends once");
    assert!(!sim.s.cancel(sim.now, a), "nothing left to cancel");
    assert_eq!(sim.s.kv_usage().used, 0);
    sim.execute(&p);
    match &sim.reqs[&a].end {
        Some(End::Finished(FinishReason::Stop, usage, t)) => {
            assert_eq!(usage.completion_tokens as usize, sim.reqs[&a].out.len());
            assert!(usage.completion_tokens >= 3, "{usage:?}");
            assert!(t.ttft.is_some());
        }
        other => panic!("expected Finished(Stop), got {other:?}"),
    }
    assert_eq!(sim.s.counters().finished, 1);
    assert_eq!(sim.s.counters().cancelled, 0);
    assert!(sim.s.is_idle());
    sim.assert_all_done();
}

/// A step time target (`step_time_max`): the scheduler learns what a step
/// costs from the steps it ran (here 2 ms + 0.5 ms per token) and sizes
/// prefill chunks so that a step carrying a prompt stays within it, every
/// running decode still in it; prompts still advance at least a block per
/// step when the decodes alone reach the target; the output is the same.
#[test]
fn a_step_time_target_sizes_chunks_from_the_measured_step_cost() {
    let run = |target_ms: u64| {
        let mut c = two_tiers(1024, 16);
        c.max_num_seqs = 16;
        c.max_num_batched_tokens = 512;
        c.step_time_max = Some(Duration::from_millis(target_ms));
        let mut sim = Sim::new(c);
        sim.step_cost_us = (2000, 500);
        let step = |sim: &mut Sim| sim.step();
        // Nothing measured yet: the first prompt fills the token budget.
        let first = sim.submit(0, 300, 60).unwrap();
        assert_eq!(step(&mut sim).num_tokens(), 300);
        for i in 0..7 {
            sim.submit(i % 2, 20, 60).unwrap();
        }
        assert_eq!(step(&mut sim).num_tokens(), 1 + 7 * 20);
        for _ in 0..2 {
            assert_eq!(step(&mut sim).num_tokens(), 8);
        }
        let line = sim.s.step_cost().expect("four steps measured");
        assert!((line.fixed - 0.002).abs() < 1e-6, "{line:?}");
        assert!((line.per_token - 0.0005).abs() < 1e-8, "{line:?}");
        // A long prompt arrives while eight streams decode.
        let long = sim.submit(1, 400, 4).unwrap();
        let mut steps = Vec::new();
        while sim.reqs[&long].computed < 400 && steps.len() < 100 {
            steps.push(step(&mut sim));
        }
        assert!(sim.reqs[&first].end.is_none());
        sim.run_until_idle(400);
        sim.assert_all_done();
        steps
    };
    // 40 ms: (40 - 2) / 0.5 = 76 tokens a step, the 8 decodes in each.
    let steps = run(40);
    for p in &steps {
        assert_eq!(p.items.iter().filter(|i| i.tokens.len() == 1).count(), 8);
        assert!(p.num_tokens() <= 76, "{} tokens", p.num_tokens());
    }
    assert_eq!(steps[0].num_tokens(), 76, "the chunk fills the target");
    assert_eq!(steps.len(), 400usize.div_ceil(68));
    // 5 ms: the decodes alone pass it (6 tokens); the prompt still takes
    // a block (16 tokens) per step beside them.
    let steps = run(5);
    for p in &steps {
        assert_eq!(p.items.iter().filter(|i| i.tokens.len() == 1).count(), 8);
        assert_eq!(p.num_tokens(), 8 + 16, "{} tokens", p.num_tokens());
    }
    assert_eq!(steps.len(), 400 / 16);
}

/// Submits `max_tokens` for a prompt of `len` new tokens with the model's
/// stop token ignored (a multi-step plan may take it).
fn submit_unwatched(sim: &mut Sim, tenant: usize, len: usize, max_tokens: u32) -> RequestId {
    let mut req = Sim::request(tenant, sim.unique_prompt(len), max_tokens);
    req.ignore_eos = true;
    sim.submit_req(req).unwrap()
}

#[test]
fn a_multi_step_plan_holds_the_decodes_until_anything_else_is_to_do() {
    let mut c = two_tiers(256, 4);
    c.max_num_seqs = 4;
    c.max_num_batched_tokens = 64;
    c.decode_steps = 8;
    let mut sim = Sim::new(c);
    let a = submit_unwatched(&mut sim, 0, 6, 20);
    let b = submit_unwatched(&mut sim, 1, 5, 11);
    // The prompts: one step.
    let p = sim.step();
    assert_eq!((ids(&p), p.steps), (vec![a, b], 1));
    // Both decode and nothing waits: as many steps as the configured most,
    // and no more than B's 10 tokens left allow.
    let p = sim.plan();
    assert_eq!((ids(&p), p.steps), (vec![a, b], 8));
    // The leases cover every step's position: A's decode at 6 writes 6..14.
    assert!(item(&p, a).unwrap().block_table.len() * 4 >= 6 + 8);
    sim.execute(&p);
    assert_eq!(sim.reqs[&a].out.len(), 9);
    assert_eq!(sim.reqs[&b].out.len(), 9);
    // B has 2 tokens left: the plan stops where B ends, so B's last token
    // ends a plan.
    let p = sim.plan();
    assert_eq!(p.steps, 2);
    // Cut after one step (a request arrived): what ran is kept, the rest of
    // the leases goes back, and the next plan (a prompt among the decodes)
    // is one step.
    let free_before = sim.s.status().kv.free;
    sim.execute_steps(&p, 1);
    assert_eq!(sim.reqs[&b].out.len(), 10);
    assert!(sim.s.status().kv.free >= free_before);
    let c_id = submit_unwatched(&mut sim, 0, 3, 4);
    let p = sim.step();
    assert_eq!((ids(&p), p.steps), (vec![a, b, c_id], 1));
    assert!(matches!(
        sim.reqs[&b].end,
        Some(End::Finished(FinishReason::Length, ..))
    ));
    // A request with a stop token id of its own keeps the plans to one
    // step: its stop must be seen after each token.
    let mut req = Sim::request(1, sim.unique_prompt(3), 30);
    req.ignore_eos = true;
    req.stop_token_ids = vec![3];
    let d = sim.submit_req(req).unwrap();
    sim.step();
    for _ in 0..3 {
        let p = sim.step();
        assert!(ids(&p).contains(&d));
        assert_eq!(p.steps, 1);
    }
    sim.cancel(d);
    sim.run_until_idle(100);
    sim.assert_all_done();
    // Every token is the fake model's at its position (the harness checks
    // each), whatever the plans' lengths.
    assert_eq!(sim.reqs[&a].out.len(), 20);
}

#[test]
fn a_first_token_is_never_held_for_a_multi_step_plan() {
    // A prompt cached but for its last token computes one position, as a
    // decode does; its first token still goes out after that one step.
    let mut c = two_tiers(64, 4);
    c.max_num_seqs = 4;
    c.max_num_batched_tokens = 64;
    c.decode_steps = 16;
    let mut sim = Sim::new(c);
    let prompt = sim.unique_prompt(8);
    let mut first = Sim::request(0, prompt.clone(), 1);
    first.ignore_eos = true;
    let a = sim.submit_req(first).unwrap();
    sim.run_until_idle(100);
    assert!(sim.reqs[&a].end.is_some());
    assert_eq!(
        sim.s.status().kv.cached,
        2,
        "the prompt's two blocks stay cached"
    );
    let mut longer = prompt;
    longer.push(7);
    let mut second = Sim::request(0, longer, 20);
    second.ignore_eos = true;
    let b = sim.submit_req(second).unwrap();
    let p = sim.plan();
    let it = item(&p, b).unwrap();
    assert_eq!((it.start_pos, it.tokens.len()), (8, 1), "one position left");
    assert_eq!(p.steps, 1, "its first token waits for no later step");
    sim.execute(&p);
    assert_eq!(sim.reqs[&b].out.len(), 1);
    // From its second token on, a plan may hold several.
    let p = sim.plan();
    assert!(p.steps > 1, "{}", p.steps);
    sim.execute(&p);
    sim.run_until_idle(100);
    sim.assert_all_done();
}

#[test]
fn a_multi_step_plan_never_evicts_a_cached_prefix_for_its_later_steps() {
    // 6 blocks of 4: two prompts of 8 (4 blocks), then the second ends and
    // its 2 blocks stay in the prefix cache.
    let mut c = two_tiers(6, 4);
    c.max_num_seqs = 2;
    c.max_num_batched_tokens = 64;
    c.decode_steps = 16;
    let mut sim = Sim::new(c);
    let a = submit_unwatched(&mut sim, 0, 7, 12);
    let b = submit_unwatched(&mut sim, 0, 8, 1);
    sim.step();
    assert!(sim.reqs[&b].end.is_some());
    assert_eq!(sim.s.status().kv.cached, 2);
    // A alone: 11 tokens left, but 16 - 4 free positions would need the
    // cached blocks: the plan holds what the free blocks cover.
    let p = sim.plan();
    assert_eq!(ids(&p), [a]);
    assert!(p.steps > 1, "{}", p.steps);
    assert!(
        7 + p.steps <= 4 * 4,
        "{} steps need a cached block",
        p.steps
    );
    assert_eq!(sim.s.status().kv.cached, 2);
    sim.execute(&p);
    sim.run_until_idle(100);
    sim.assert_all_done();
}

/// Plans until `depth` are in flight (or none can be made), then
/// completes the oldest, until idle: a pipeline's engine.
fn run_pipelined(sim: &mut Sim, max_steps: usize) -> usize {
    let mut q = std::collections::VecDeque::new();
    let mut most = 0;
    for _ in 0..max_steps {
        while sim.s.may_plan() {
            let p = sim.plan();
            if p.items.is_empty() {
                break;
            }
            // Disjoint from every plan in flight.
            for other in &q {
                let o: &Plan = other;
                assert!(ids(&p).iter().all(|id| !ids(o).contains(id)));
            }
            q.push_back(p);
        }
        most = most.max(q.len());
        match q.pop_front() {
            Some(p) => sim.execute(&p),
            None if sim.s.is_idle() => return most,
            None => {}
        }
    }
    panic!("not idle after {max_steps} steps");
}

#[test]
fn two_steps_in_flight_take_disjoint_halves_in_order() {
    let mut c = two_tiers(256, 16);
    c.max_num_seqs = 16;
    c.max_num_batched_tokens = 512;
    let mut sim = Sim::new(c);
    sim.s.set_depth(2);
    let reqs: Vec<RequestId> = (0..8).map(|i| sim.submit(i % 2, 10, 20).unwrap()).collect();
    let a = sim.plan();
    let b = sim.plan();
    assert_eq!((a.items.len(), b.items.len()), (4, 4), "even halves");
    assert!(!sim.s.may_plan(), "two in flight at most");
    assert_eq!(sim.s.num_in_flight(), 2);
    sim.execute(&a);
    // The next plan takes the sequences that are not in flight: a's.
    let a2 = sim.plan();
    assert_eq!(ids(&a2), ids(&a));
    // A cancel in flight: the step's result skips it.
    assert!(sim.cancel(ids(&b)[0]));
    sim.execute(&b);
    sim.execute(&a2);
    assert!(run_pipelined(&mut sim, 500) >= 2);
    assert_eq!(reqs.len(), 8);
    sim.assert_all_done();
}

#[test]
fn steps_in_flight_are_never_preempted() {
    // 24 blocks of 16 for 12 requests of 4 blocks each: preemption.
    let mut c = two_tiers(24, 16);
    c.max_num_seqs = 12;
    c.max_num_batched_tokens = 256;
    let mut sim = Sim::new(c);
    sim.s.set_depth(3);
    for i in 0..12 {
        let p = sim.unique_prompt(30);
        sim.submit_req(Sim::request(i % 2, p, 30)).unwrap();
    }
    assert!(run_pipelined(&mut sim, 2000) >= 2);
    assert!(sim.s.counters().preemptions > 0, "the test preempts");
    sim.assert_all_done();
}

#[test]
fn a_sequence_cancelled_in_flight_is_not_counted_free() {
    let mut c = two_tiers(256, 16);
    c.max_num_seqs = 4;
    let mut sim = Sim::new(c);
    sim.s.set_depth(2);
    let a = sim.submit(0, 10, 20).unwrap();
    let p = sim.plan();
    assert_eq!(ids(&p), [a]);
    // In flight, then cancelled: the next plan has nothing to take (and
    // counting it as free would be one more than is running).
    assert!(sim.cancel(a));
    assert!(sim.s.may_plan());
    assert!(sim.plan().items.is_empty());
    let b = sim.submit(1, 10, 4).unwrap();
    let q = sim.plan();
    assert_eq!(ids(&q), [b]);
    sim.execute(&p);
    sim.execute(&q);
    assert!(run_pipelined(&mut sim, 100) >= 1);
    sim.assert_all_done();
}
