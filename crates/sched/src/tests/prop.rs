//! Random interleavings of submit, cancel, schedule, complete and failures on
//! small pools; every invariant is checked after every operation.

use std::time::Duration;

use proptest::prelude::*;

use super::{Sim, tok};
use crate::config::tests::two_tiers;
use crate::{Batching, SchedConfig, Speculation};

#[derive(Clone, Debug)]
pub(crate) enum Op {
    Submit {
        tenant: usize,
        prompt: usize,
        max_tokens: u32,
        /// Prompt taken from one of a few shared texts (prefix cache hits).
        shared: Option<u8>,
        stop: bool,
        /// The prompt ends with a copy of what the fake model will say next
        /// (speculation's drafts find it), corrupted part way when true.
        echo: Option<bool>,
    },
    Cancel(usize),
    Step,
    /// Schedule, cancel a request, then complete.
    CancelMid(usize),
    /// Schedule, then complete only some steps of a multi-step plan (the
    /// Scheduler's actor cut it short).
    CutMid(usize),
    FailStep,
    Advance(u64),
    /// Schedule, let time pass and expire queued requests, then complete.
    ExpireMid(u64),
    /// The engine breaks, with or without a step in flight.
    FailAll(bool),
}

pub(crate) fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => (0..3usize, 1..40usize, 1..20u32, proptest::option::of(0..3u8), proptest::bool::weighted(0.2), proptest::option::of(any::<bool>()))
            .prop_map(|(tenant, prompt, max_tokens, shared, stop, echo)| Op::Submit { tenant, prompt, max_tokens, shared, stop, echo }),
        2 => (0..1000usize).prop_map(Op::Cancel),
        16 => Just(Op::Step),
        2 => (0..1000usize).prop_map(Op::CancelMid),
        2 => (0..8usize).prop_map(Op::CutMid),
        2 => Just(Op::FailStep),
        2 => (0..3000u64).prop_map(Op::Advance),
        2 => (0..3000u64).prop_map(Op::ExpireMid),
        1 => any::<bool>().prop_map(Op::FailAll),
    ]
}

pub(crate) fn config() -> impl Strategy<Value = SchedConfig> {
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
            prop_oneof![Just(0u32), 1..24u32],
        ),
        (
            1..5u64,
            0..4u32,
            proptest::option::of(5..60u32),
            proptest::option::of((1..6usize, 1..4usize, 1..6usize)),
            proptest::option::of(1..12usize),
        ),
        // Step time targets, in steps of the fake executor's cost (1 ms +
        // 0.25 ms per token): the global one, the paid tier's.
        // Multi-step decode: off, or up to 3 or 8 steps a plan.
        (
            proptest::option::of(1..40u64),
            proptest::option::of(1..12u64),
            prop_oneof![Just(1usize), Just(1), Just(3), Just(8)],
        ),
    )
        .prop_map(
            |(
                (blocks, bs, seqs, budget),
                (stat, reserved, quota, salted, offload),
                (timeout, conc, rpm, spec, latency_budget),
                (step_time, paid_step_time, decode_steps),
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
                c.tiers[1].step_tokens_max = latency_budget;
                c.step_time_max = step_time.map(|q| Duration::from_micros(250 * q));
                c.decode_steps = decode_steps;
                c.tiers[1].step_time_max =
                    paid_step_time.map(|q| Duration::from_micros(1000 + 250 * q));
                c.tenants[1].kv_blocks_max = quota;
                c.tenants[2].prefix_salt = if salted { 5 } else { 0 };
                c.offload_blocks = offload;
                c.queue_timeout = Duration::from_secs(timeout);
                c.tenants[0].max_concurrent = conc;
                c.tenants[1].requests_per_minute = rpm;
                if let Some((max_draft, ngram_min, max_batch)) = spec
                    && max_draft < budget
                {
                    c.speculation = Speculation {
                        max_draft,
                        ngram_min,
                        ngram_max: 4,
                        max_batch,
                        // Below what the seats could draft, at times.
                        max_step: 1 + max_draft * max_batch / 2,
                        self_layers: 0,
                        // A draft model's placeholders at times (the
                        // worker that fills them is not here; they are
                        // verified, and rejected, all the same).
                        draft_model: max_draft % 2 == 0,
                        draft_p_min: 0.0,
                    };
                }
                c
            },
        )
}

/// Eleven tokens to end a prompt of `len` tokens with: a marker, then the
/// nine tokens the fake model will say after it (one of them wrong when
/// `corrupt`), then the marker again, so that the first decode's last two
/// tokens (marker, first output) occur earlier, followed by a draft.
pub(crate) fn echo_tail(id: flotilla_proto::RequestId, len: usize, corrupt: bool) -> Vec<u32> {
    const MARK: u32 = 9;
    let first = len + 11;
    let mut t = vec![MARK];
    t.extend((0..9).map(|i| tok(id, first + i)));
    if corrupt {
        t[5] = 8;
    }
    t.push(MARK);
    t
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

/// Applies `ops`, runs to idle and checks that everything ended; returns
/// the scheduler's counters.
pub(crate) fn run(cfg: SchedConfig, ops: Vec<Op>) -> crate::Counters {
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
                echo,
            } => {
                let mut tokens = match shared {
                    Some(k) => texts[usize::from(k)][..prompt].to_vec(),
                    None => sim.unique_prompt(prompt),
                };
                if let Some(corrupt) = echo {
                    let id = flotilla_proto::RequestId(sim.next_id);
                    tokens.extend(echo_tail(id, tokens.len(), corrupt));
                }
                let prompt = tokens.len();
                let mut req = Sim::request(tenant, tokens, max_tokens);
                // The fake model never says the model's stop token: ignoring
                // it changes no output, and lets the request into a
                // multi-step plan (one with a stop id of its own never is).
                req.ignore_eos = true;
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
            Op::CutMid(k) => {
                let plan = sim.plan();
                sim.execute_steps(&plan, 1 + k % plan.steps);
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
    sim.s.counters()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn random_interleavings_keep_every_invariant(cfg in config(), ops in proptest::collection::vec(op(), 1..120)) {
        run(cfg, ops);
    }
}
