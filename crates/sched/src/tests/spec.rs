//! Speculative decoding in the scheduler: drafts found in the sequence's own
//! text, verified by the step, the same tokens as without, fewer steps, and
//! every block of a rejected draft given back.

use super::prop::echo_tail;
use super::{End, Sim};
use crate::Speculation;
use crate::config::tests::two_tiers;
use flotilla_proto::{EngineRequest, RequestId};

/// The next request `sim` will accept: `len` unique prompt tokens, then the
/// fake model's own next tokens (one corrupted when `corrupt`), so that its
/// first decode finds a draft.
fn echo_request(
    sim: &Sim,
    tenant: usize,
    len: usize,
    corrupt: bool,
    max_tokens: u32,
) -> EngineRequest {
    let mut prompt = sim.unique_prompt(len);
    prompt.extend(echo_tail(RequestId(sim.next_id), len, corrupt));
    Sim::request(tenant, prompt, max_tokens)
}

/// Three requests whose prompts end with what the fake model will say next
/// (one copy corrupted), each run with speculation off and on.
fn run(spec: Speculation) -> (Sim, Vec<RequestId>) {
    let mut cfg = two_tiers(64, 4);
    cfg.speculation = spec;
    let mut sim = Sim::new(cfg);
    let mut ids = Vec::new();
    for (k, corrupt) in [false, true, false].into_iter().enumerate() {
        // 120 tokens: the fake model's text repeats every 50, so later
        // drafts come from the output itself.
        let req = echo_request(&sim, k % 3, 6 + k, corrupt, 120);
        ids.push(sim.submit_req(req).expect("accepted"));
    }
    sim.run_until_idle(1000);
    sim.assert_all_done();
    (sim, ids)
}

#[test]
fn drafts_give_the_same_tokens_in_fewer_steps_and_return_their_blocks() {
    let (off, ids) = run(Speculation::OFF);
    let (on, ids_on) = run(Speculation {
        max_batch: 4,
        ..Speculation::ngram(4)
    });
    assert_eq!(ids, ids_on);
    for id in &ids {
        assert_eq!(on.reqs[id].out, off.reqs[id].out, "{id}: tokens differ");
        assert_eq!(on.reqs[id].out.len(), 120);
    }
    let c = on.s.counters();
    assert_eq!(off.s.counters().drafted_tokens, 0);
    assert!(c.accepted_tokens > 0, "no draft accepted: {c:?}");
    assert!(
        c.accepted_tokens < c.drafted_tokens,
        "the corrupted copy must have cost a rejection: {c:?}"
    );
    // Every accepted draft token is a token without a step of its own.
    assert!(
        on.steps < off.steps,
        "{} steps with speculation, {} without, {} accepted",
        on.steps,
        off.steps,
        c.accepted_tokens
    );
    // Per request, in the finish event's timings.
    let mut drafted = 0;
    for id in &ids {
        let Some(End::Finished(_, _, t)) = &on.reqs[id].end else {
            panic!("{id} did not finish");
        };
        assert!(t.accepted <= t.drafted);
        drafted += u64::from(t.drafted);
    }
    assert_eq!(drafted, c.drafted_tokens);
}

#[test]
fn a_request_that_opts_out_gets_no_draft_and_one_with_penalties_does() {
    let mut outs = Vec::new();
    for (spec, opt_out, penalised) in [
        (Speculation::OFF, false, true),
        (Speculation::ngram(4), true, true),
        (Speculation::ngram(4), false, true),
    ] {
        let mut cfg = two_tiers(64, 4);
        cfg.speculation = spec;
        let mut sim = Sim::new(cfg);
        let id = RequestId(sim.next_id);
        let mut req = echo_request(&sim, 0, 6, false, 60);
        req.speculative = !opt_out;
        if penalised {
            req.sampling.presence_penalty = 0.5;
            req.sampling.frequency_penalty = 0.25;
        }
        sim.submit_req(req).expect("accepted");
        sim.run_until_idle(1000);
        sim.assert_all_done();
        let drafted = sim.s.counters().drafted_tokens;
        assert_eq!(drafted > 0, spec.is_on() && !opt_out, "{drafted} drafted");
        assert_eq!(sim.reqs[&id].out.len(), 60);
        outs.push(sim.reqs[&id].out.clone());
    }
    assert!(
        outs.iter().all(|o| *o == outs[0]),
        "the same tokens every way"
    );
}

#[test]
fn no_draft_in_a_step_with_more_decodes_than_the_bound() {
    let mut cfg = two_tiers(256, 4);
    cfg.speculation = Speculation {
        max_batch: 2,
        ..Speculation::ngram(4)
    };
    let mut sim = Sim::new(cfg);
    for _ in 0..3 {
        let req = echo_request(&sim, 0, 6, false, 30);
        sim.submit_req(req).expect("accepted");
    }
    // All three decode together from the second step on: never a draft.
    for _ in 0..10 {
        let plan = sim.step();
        let decodes = plan.items.iter().filter(|i| i.sample.is_some()).count();
        if decodes > 2 {
            assert!(plan.items.iter().all(|i| i.draft == 0), "{plan:?}");
        }
    }
    sim.run_until_idle(1000);
    sim.assert_all_done();
}

/// Under a paid latency budget the paid decodes keep their drafts beside a
/// free flood: the free decodes (held to the budget) neither count toward
/// the speculation bound nor get drafts themselves.
#[test]
fn paid_decodes_keep_their_drafts_under_a_latency_budget() {
    let mut cfg = two_tiers(512, 4);
    cfg.max_num_seqs = 16;
    cfg.tiers[1].step_tokens_max = Some(3);
    cfg.speculation = Speculation {
        max_batch: 2,
        ..Speculation::ngram(4)
    };
    let mut sim = Sim::new(cfg);
    for i in 0..6 {
        let req = echo_request(&sim, i % 2, 6, false, 200);
        sim.submit_req(req).expect("accepted");
    }
    for _ in 0..4 {
        sim.step();
    }
    let paid: Vec<_> = (0..2)
        .map(|_| {
            let req = echo_request(&sim, 2, 6, false, 40);
            sim.submit_req(req).expect("accepted")
        })
        .collect();
    let (mut paid_drafts, mut free_decodes) = (0, 0);
    for _ in 0..12 {
        let plan = sim.step();
        for i in &plan.items {
            if paid.contains(&i.id) {
                paid_drafts += i.draft;
            } else {
                assert_eq!(i.draft, 0, "a free decode got a draft: {plan:?}");
                free_decodes += 1;
            }
        }
    }
    assert!(paid_drafts > 0, "the paid decodes got no draft");
    assert!(free_decodes > 0, "the free decodes starved");
    sim.run_until_idle(2000);
    sim.assert_all_done();
}

/// The random interleavings of `prop` (cancels mid-step, failed steps,
/// expiries, preemptions on small pools, quotas) with speculation always
/// on: every invariant holds after every operation, every output equals
/// the fake model's, every block comes back, and drafts were both accepted
/// and rejected along the way (the paths were exercised, not skipped).
#[test]
fn random_interleavings_with_speculation_keep_every_invariant() {
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};

    let strategy = (
        super::prop::config().prop_filter("speculation fits the step", |c| {
            c.max_num_batched_tokens > 4
        }),
        proptest::collection::vec(super::prop::op(), 1..120),
        1..5usize,
    );
    let mut runner = TestRunner::new(Config {
        cases: 300,
        ..Config::default()
    });
    let totals = std::cell::Cell::new((0u64, 0u64));
    runner
        .run(&strategy, |(mut cfg, ops, max_draft)| {
            cfg.speculation = Speculation {
                max_draft: max_draft.min(cfg.max_num_batched_tokens - 1),
                max_batch: 8,
                ..Speculation::ngram(4)
            };
            let c = super::prop::run(cfg, ops);
            let (d, a) = totals.get();
            totals.set((d + c.drafted_tokens, a + c.accepted_tokens));
            Ok(())
        })
        .unwrap();
    let (drafted, accepted) = totals.get();
    eprintln!("{accepted} of {drafted} draft tokens accepted over 300 cases");
    assert!(
        accepted > 0 && accepted < drafted,
        "drafts never accepted or never rejected: {accepted} of {drafted}"
    );
}

#[test]
fn a_step_carries_at_most_the_backends_draft_rows() {
    let mut cfg = two_tiers(256, 4);
    cfg.speculation = Speculation {
        max_batch: 4,
        max_step: 3,
        ..Speculation::ngram(4)
    };
    let mut sim = Sim::new(cfg);
    for _ in 0..2 {
        let req = echo_request(&sim, 0, 6, false, 40);
        sim.submit_req(req).expect("accepted");
    }
    let mut most = 0;
    while !sim.s.is_idle() {
        let plan = sim.step();
        let drafted: usize = plan.items.iter().map(|i| i.draft).sum();
        assert!(drafted <= 3, "{drafted} draft tokens in one step: {plan:?}");
        most = most.max(drafted);
    }
    assert_eq!(most, 3, "the cap was never reached");
    sim.assert_all_done();
}

#[test]
fn where_the_lookup_finds_nothing_a_self_draft_is_planned_and_kept_exact() {
    let mut cfg = two_tiers(64, 4);
    cfg.speculation = Speculation::self_draft(4, 20);
    let mut sim = Sim::new(cfg);
    // A prompt that never repeats: no n-gram to find.
    let plain = sim.submit_req(Sim::request(0, sim.unique_prompt(8), 24));
    let plain = plain.expect("accepted");
    let mut penalised = Sim::request(0, sim.unique_prompt(8), 24);
    penalised.sampling.presence_penalty = 0.5;
    let penalised = sim.submit_req(penalised).expect("accepted");
    let mut seen = 0;
    for _ in 0..6 {
        let plan = sim.step();
        for it in plan.items.iter().filter(|i| i.draft > 0) {
            // Only where bias and mask do not change with the draft; its
            // tokens are placeholders for the worker to fill.
            assert_eq!(it.id, plain, "{plan:?}");
            assert_eq!(it.self_draft, 20);
            assert!(it.draft_bias.is_empty() && it.allow.is_none());
            seen += 1;
        }
    }
    assert!(seen > 0, "no self-draft planned");
    sim.run_until_idle(1000);
    sim.assert_all_done();
    // The fake model's tokens whatever the guesses were.
    for id in [plain, penalised] {
        assert_eq!(sim.reqs[&id].out.len(), 24);
    }
    assert_eq!(sim.s.kv_usage().used, 0, "every block given back");
}

#[test]
fn a_draft_model_drafts_as_long_as_the_cost_sum_says_and_not_where_it_would_lose() {
    use std::time::Duration;
    let ms = |v: f64| Duration::from_secs_f64(v / 1000.0);
    let mut cfg = two_tiers(64, 4);
    // N-gram drafts only in steps of no decodes: none here, so every
    // draft is the draft model's.
    cfg.speculation = Speculation {
        max_batch: 0,
        ..Speculation::draft_model(6)
    };
    let mut sim = Sim::new(cfg);
    let prompt = sim.unique_prompt(8);
    let id = sim.submit_req(Sim::request(0, prompt, 200));
    let id = id.expect("accepted");
    // The plan's items whose placeholders the draft model fills: each
    // carries the sequence's tokens before it.
    let drafts = |sim: &mut Sim| -> Vec<usize> {
        let plan = sim.step();
        let mut lens = Vec::new();
        for it in plan.items.iter().filter(|i| i.draft > 0) {
            let history = it.model_draft.as_ref().expect("only model drafts");
            assert_eq!(it.id, id);
            assert_eq!(history.len(), it.start_pos);
            assert_eq!(&sim.reqs[&id].prompt[..8], &history[..8]);
            assert!(it.draft_bias.is_empty() && it.allow.is_none());
            lens.push(it.draft);
        }
        lens
    };
    // Before both costs are measured: the whole length, so that they are.
    let early: Vec<usize> = (0..3).flat_map(|_| drafts(&mut sim)).collect();
    assert!(early.contains(&6), "{early:?}");
    // A step reads the weights once (40 ms) and each position adds 2 ms;
    // the draft's pass costs 10 ms and 0.5 ms a position: it pays, and
    // the plan drafts the cost sum's length.
    sim.s.step_cost = Default::default();
    sim.step_cost_us = (40_000, 2_000);
    for n in [1, 5, 1, 7, 2, 3, 1, 5] {
        sim.s.step_cost.observe(n, n, ms(40.0 + 2.0 * n as f64));
    }
    for n in [1, 2, 1, 2, 1] {
        sim.s.draft_cost.observe(n, 1, ms(10.0 + 0.5 * n as f64));
    }
    // An engine whose drafts were right 90% of the time, and a sequence
    // with no drafts of its own yet (the fake model rejected the ones above).
    sim.s.draft_accept = (9.0, 1.0);
    let fresh = |sim: &mut Sim| {
        let spec = &mut sim.s.seqs.get_mut(&id).unwrap().spec;
        (
            spec.model_accepted,
            spec.model_cut,
            spec.backoff,
            spec.skip_until,
        ) = (0.0, 0.0, 0, 0);
    };
    fresh(&mut sim);
    let (k, gain) = sim.s.draft_plan(1).expect("both costs measured");
    assert!(k >= 3 && gain > 1.5, "{k} {gain}");
    // The placeholders are never filled here, so every draft is
    // rejected: this sequence's own acceptance falls (and the engine's
    // with it), its drafts shorten, and then stop.
    let mut planned = Vec::new();
    for _ in 0..60 {
        planned.extend(drafts(&mut sim));
    }
    assert_eq!(planned.first(), Some(&k), "{planned:?}");
    assert!(planned.iter().all(|&l| l >= 1), "{planned:?}");
    assert!(planned.windows(2).all(|w| w[1] <= w[0]), "{planned:?}");
    // Not the back-off after a rejection: the cost sum at its acceptance.
    let spec = &mut sim.s.seqs.get_mut(&id).unwrap().spec;
    (spec.backoff, spec.skip_until) = (0, 0);
    assert!(
        (0..20).all(|_| drafts(&mut sim).is_empty()),
        "still drafting after {planned:?}"
    );
    assert!(
        sim.s.draft_acceptance() < 0.7,
        "{}",
        sim.s.draft_acceptance()
    );
    // Its own drafts, right this time, at the engine's fallen acceptance
    // (the step cost as measured before; steps of one token since taught
    // the fit nothing it can split): its length comes back.
    fresh(&mut sim);
    let spec = &mut sim.s.seqs.get_mut(&id).unwrap().spec;
    spec.model_accepted = 40.0;
    spec.model_cut = 2.0;
    for n in [1, 5, 1, 7, 2, 3, 1, 5] {
        sim.s.step_cost.observe(n, n, ms(40.0 + 2.0 * n as f64));
    }
    let got = drafts(&mut sim);
    assert!(got.first().is_some_and(|&l| l >= 3), "{got:?}");
    // A machine where a position costs as much as a step: drafting would
    // lose, and nothing is drafted.
    sim.s.step_cost = Default::default();
    sim.step_cost_us = (1_000, 40_000);
    for n in [1, 5, 1, 7, 2, 3, 1, 5] {
        sim.s.step_cost.observe(n, n, ms(1.0 + 40.0 * n as f64));
    }
    assert_eq!(sim.s.draft_plan(1), Some((0, 1.0)));
    for _ in 0..10 {
        assert!(drafts(&mut sim).is_empty());
    }
    sim.run_until_idle(1000);
    sim.assert_all_done();
    assert_eq!(sim.reqs[&id].out.len(), 200);
    assert_eq!(sim.s.kv_usage().used, 0, "every block given back");
}
