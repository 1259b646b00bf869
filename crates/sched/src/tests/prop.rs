//! Random interleavings of submit, cancel, schedule, complete and failures on
//! small pools; every invariant is checked after every operation.

use std::time::Duration;

use proptest::prelude::*;

use super::{Sim, tok};
use crate::config::tests::two_tiers;
use crate::{Batching, SchedConfig};

#[derive(Clone, Debug)]
enum Op {
    Submit {
        tenant: usize,
        prompt: usize,
        max_tokens: u32,
        /// Prompt taken from one of a few shared texts (prefix cache hits).
        shared: Option<u8>,
        stop: bool,
    },
    Cancel(usize),
    Step,
    /// Schedule, cancel a request, then complete.
    CancelMid(usize),
    FailStep,
    Advance(u64),
    /// Schedule, let time pass and expire queued requests, then complete.
    ExpireMid(u64),
    /// The engine breaks, with or without a step in flight.
    FailAll(bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => (0..3usize, 1..40usize, 1..20u32, proptest::option::of(0..3u8), proptest::bool::weighted(0.2))
            .prop_map(|(tenant, prompt, max_tokens, shared, stop)| Op::Submit { tenant, prompt, max_tokens, shared, stop }),
        2 => (0..1000usize).prop_map(Op::Cancel),
        16 => Just(Op::Step),
        2 => (0..1000usize).prop_map(Op::CancelMid),
        2 => Just(Op::FailStep),
        2 => (0..3000u64).prop_map(Op::Advance),
        2 => (0..3000u64).prop_map(Op::ExpireMid),
        1 => any::<bool>().prop_map(Op::FailAll),
    ]
}

fn config() -> impl Strategy<Value = SchedConfig> {
    (
        (
            12..48u32,
            prop_oneof![Just(2u32), Just(4), Just(8)],
            1..6usize,
            1..48usize,
        ),
        (
            any::<bool>(),
            0..4u32,
            proptest::option::of(6..20u32),
            any::<bool>(),
        ),
        (1..5u64, 0..4u32, proptest::option::of(5..60u32)),
    )
        .prop_map(
            |(
                (blocks, bs, seqs, budget),
                (stat, reserved, quota, salted),
                (timeout, conc, rpm),
            )| {
                let mut c = two_tiers(blocks, bs);
                c.max_num_seqs = seqs;
                c.max_num_batched_tokens = budget;
                c.max_model_len = 64;
                c.batching = if stat {
                    Batching::Static
                } else {
                    Batching::Continuous
                };
                c.tiers[1].kv_reserved_blocks = reserved;
                c.tenants[1].kv_blocks_max = quota;
                c.tenants[2].prefix_salt = if salted { 5 } else { 0 };
                c.queue_timeout = Duration::from_secs(timeout);
                c.tenants[0].max_concurrent = conc;
                c.tenants[1].requests_per_minute = rpm;
                c
            },
        )
}

fn live(sim: &Sim, idx: usize) -> Option<flotilla_proto::RequestId> {
    let live: Vec<_> = sim
        .reqs
        .iter()
        .filter(|(_, t)| t.end.is_none() && !t.cancelled)
        .map(|(id, _)| *id)
        .collect();
    (!live.is_empty()).then(|| live[idx % live.len()])
}

fn run(cfg: SchedConfig, ops: Vec<Op>) {
    let mut sim = Sim::new(cfg);
    sim.tick = Duration::from_millis(50);
    let texts: Vec<Vec<u32>> = (0..3)
        .map(|k| (0..40).map(|i| 1000 * (k + 1) + i).collect())
        .collect();
    for op in ops {
        match op {
            Op::Submit {
                tenant,
                prompt,
                max_tokens,
                shared,
                stop,
            } => {
                let tokens = match shared {
                    Some(k) => texts[usize::from(k)][..prompt].to_vec(),
                    None => sim.unique_prompt(prompt),
                };
                let mut req = Sim::request(tenant, tokens, max_tokens);
                if stop {
                    let id = flotilla_proto::RequestId(sim.next_id);
                    req.stop_token_ids = vec![tok(id, prompt + 2)];
                }
                let _ = sim.submit_req(req);
            }
            Op::Cancel(i) => {
                if let Some(id) = live(&sim, i) {
                    sim.cancel(id);
                }
            }
            Op::Step => {
                sim.step();
            }
            Op::CancelMid(i) => {
                let plan = sim.plan();
                if let Some(id) = live(&sim, i) {
                    sim.cancel(id);
                }
                sim.execute(&plan);
            }
            Op::FailStep => {
                let plan = sim.plan();
                let now = sim.now;
                sim.s.fail_step(now, &plan, "injected");
                sim.collect();
                sim.check();
                for item in &plan.items {
                    assert!(sim.reqs[&item.id].end.is_some() || sim.reqs[&item.id].cancelled);
                }
            }
            Op::Advance(ms) => sim.now += Duration::from_millis(ms),
            Op::ExpireMid(ms) => {
                let plan = sim.plan();
                sim.now += Duration::from_millis(ms);
                let now = sim.now;
                sim.s.expire(now);
                sim.collect();
                sim.check();
                sim.execute(&plan);
            }
            Op::FailAll(in_flight) => {
                if in_flight {
                    sim.plan();
                }
                let now = sim.now;
                sim.s
                    .fail_all(now, flotilla_proto::EngineFailure::ShuttingDown);
                sim.collect();
                sim.check();
                assert!(sim.s.is_idle());
            }
        }
    }
    sim.run_until_idle(20_000);
    sim.assert_all_done();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn random_interleavings_keep_every_invariant(cfg in config(), ops in proptest::collection::vec(op(), 1..120)) {
        run(cfg, ops);
    }
}
