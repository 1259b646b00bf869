//! Scheduler tests: a fake executor that checks every plan against a model of
//! the KV cache, and scenarios built on it.

mod basic;
mod constraint;
mod migrate;
mod prop;
mod spec;
mod tiers;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use flotilla_proto::{
    EngineFailure, EngineRequest, FinishReason, Rejection, RequestId, Sampled, SamplingParams,
    TenantId, Usage,
};

use flotilla_exec::SeqOutput;

use crate::{Plan, SchedConfig, SchedEvent, Scheduler, Timings};

/// The fake model's token after position `pos - 1`: depends only on the
/// request and the position, so a preempted and recomputed request must
/// produce exactly what it would have alone. Never 0..10 (stop tokens live there).
pub(crate) fn tok(id: RequestId, pos: usize) -> u32 {
    ((id.0 as usize + pos) % 50 + 10) as u32
}

/// How a request ended.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum End {
    Finished(FinishReason, Usage, Timings),
    Failed(EngineFailure),
}

/// What the test knows about one accepted request.
#[derive(Clone, Debug)]
pub(crate) struct Tracked {
    pub tenant: usize,
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    pub stop_ids: Vec<u32>,
    pub out: Vec<u32>,
    pub end: Option<End>,
    pub cancelled: bool,
    /// Ended by the Router at a stop string (`finish_early`).
    pub stopped_early: bool,
    pub preempted: u32,
    pub submitted_step: u64,
    pub first_planned_step: Option<u64>,
    /// Tokens computed for it, step by step (prefill chunks and decodes).
    pub computed: usize,
}

/// A scheduler driven by a fake executor that checks each plan.
pub(crate) struct Sim {
    pub s: Scheduler,
    pub now: Duration,
    pub tick: Duration,
    pub steps: u64,
    /// What each step costs the fake executor, reported to the scheduler's
    /// cost model: microseconds fixed and per token.
    pub step_cost_us: (u64, u64),
    pub reqs: BTreeMap<RequestId, Tracked>,
    /// Preempted events, in order.
    pub preempt_log: Vec<RequestId>,
    next_id: u64,
    bs: usize,
    /// Prefix hash of the token each KV slot holds (0 = never written).
    kv: Vec<u64>,
    /// The same for the offload tier's slots, block by block.
    tier: Vec<u64>,
}

/// Hash of every prefix of `tokens`: slot `p` must hold `prefix_hashes[p]`.
fn prefix_hashes(tokens: &[u32]) -> Vec<u64> {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    tokens
        .iter()
        .map(|&t| {
            h = (h ^ u64::from(t + 1)).wrapping_mul(0x0100_0000_01b3);
            h | 1
        })
        .collect()
}

impl Sim {
    pub(crate) fn new(cfg: SchedConfig) -> Sim {
        let bs = cfg.block_size as usize;
        let kv = vec![0; cfg.num_blocks as usize * bs];
        let tier = vec![0; cfg.offload_blocks as usize * bs];
        Sim {
            s: Scheduler::new(cfg).expect("valid config"),
            now: Duration::from_secs(1000),
            tick: Duration::from_millis(10),
            steps: 0,
            step_cost_us: (1000, 250),
            reqs: BTreeMap::new(),
            preempt_log: Vec::new(),
            next_id: 1,
            bs,
            kv,
            tier,
        }
    }

    /// Performs the tier moves the pool decided, in order, on the model's
    /// KV contents (what the GpuWorker does before the next step or block
    /// read or write).
    pub(crate) fn perform_moves(&mut self) {
        let bs = self.bs;
        for m in self.s.take_block_moves() {
            match m {
                flotilla_kv::BlockMove::Spill { block, slot } => {
                    let (b, s) = (block as usize * bs, slot as usize * bs);
                    self.tier[s..s + bs].copy_from_slice(&self.kv[b..b + bs]);
                }
                flotilla_kv::BlockMove::Restore { slot, block } => {
                    let (b, s) = (block as usize * bs, slot as usize * bs);
                    self.kv[b..b + bs].copy_from_slice(&self.tier[s..s + bs]);
                }
            }
        }
    }

    /// A greedy request; prompt tokens distinct per request unless given.
    pub(crate) fn request(tenant: usize, prompt: Vec<u32>, max_tokens: u32) -> EngineRequest {
        EngineRequest {
            tenant: TenantId(tenant as u32),
            prompt,
            max_tokens,
            sampling: SamplingParams::greedy(),
            logit_bias: Vec::new(),
            generated: 0,
            constraint: None,
            ignore_eos: false,
            stop_token_ids: Vec::new(),
            speculative: true,
            trace: None,
        }
    }

    /// A prompt no other request shares.
    pub(crate) fn unique_prompt(&self, len: usize) -> Vec<u32> {
        (0..len)
            .map(|i| 100 + ((self.next_id as usize * 7919 + i * 31) % 40_000) as u32)
            .collect()
    }

    pub(crate) fn submit(
        &mut self,
        tenant: usize,
        prompt_len: usize,
        max_tokens: u32,
    ) -> Result<RequestId, Rejection> {
        let prompt = self.unique_prompt(prompt_len);
        self.submit_req(Self::request(tenant, prompt, max_tokens))
    }

    pub(crate) fn submit_req(&mut self, req: EngineRequest) -> Result<RequestId, Rejection> {
        let id = RequestId(self.next_id);
        self.next_id += 1;
        self.s.submit(self.now, id, req.clone())?;
        self.track(id, &req);
        self.check();
        Ok(id)
    }

    /// Starts tracking an accepted request.
    pub(crate) fn track(&mut self, id: RequestId, req: &EngineRequest) {
        self.reqs.insert(
            id,
            Tracked {
                tenant: req.tenant.0 as usize,
                prompt: req.prompt.clone(),
                max_tokens: req.max_tokens,
                stop_ids: req.stop_token_ids.clone(),
                out: Vec::new(),
                end: None,
                cancelled: false,
                stopped_early: false,
                preempted: 0,
                submitted_step: self.steps,
                first_planned_step: None,
                computed: 0,
            },
        );
    }

    pub(crate) fn cancel(&mut self, id: RequestId) -> bool {
        let live = self
            .reqs
            .get(&id)
            .is_some_and(|t| t.end.is_none() && !t.cancelled);
        let done = self.s.cancel(self.now, id);
        assert_eq!(done, live, "cancel of {id}");
        if done {
            self.reqs.get_mut(&id).unwrap().cancelled = true;
        }
        self.check();
        done
    }

    /// The Router ends a request at a stop string.
    pub(crate) fn finish_early(&mut self, id: RequestId) -> bool {
        let live = self
            .reqs
            .get(&id)
            .is_some_and(|t| t.end.is_none() && !t.cancelled);
        let done = self.s.finish_early(self.now, id);
        assert_eq!(done, live, "finish_early of {id}");
        if done {
            self.reqs.get_mut(&id).unwrap().stopped_early = true;
        }
        self.collect();
        self.check();
        done
    }

    /// The schedule half of a step, with the plan checked.
    pub(crate) fn plan(&mut self) -> Plan {
        self.now += self.tick;
        let plan = self.s.schedule(self.now);
        self.perform_moves();
        self.collect();
        self.check_plan(&plan);
        plan
    }

    /// The execute and complete half of a step (every step of a
    /// multi-step plan).
    pub(crate) fn execute(&mut self, plan: &Plan) {
        self.execute_steps(plan, plan.steps);
    }

    /// The execute and complete half of a step, of a multi-step plan only
    /// its first `ran` steps (the worker was cut short).
    pub(crate) fn execute_steps(&mut self, plan: &Plan, ran: usize) {
        let sampled = self.run_executor(plan, ran.clamp(1, plan.steps));
        self.now += self.tick;
        self.s.complete(self.now, plan, &sampled);
        self.collect();
        self.check();
    }

    /// One full step.
    pub(crate) fn step(&mut self) -> Plan {
        let plan = self.plan();
        self.execute(&plan);
        let (fixed, per) = self.step_cost_us;
        let n = plan.num_tokens() as u64;
        self.s
            .observe_step(&plan, Duration::from_micros(fixed + per * n));
        plan
    }

    /// Steps until nothing is queued or running; panics after `max_steps`.
    pub(crate) fn run_until_idle(&mut self, max_steps: usize) {
        for _ in 0..max_steps {
            if self.s.is_idle() {
                return;
            }
            self.step();
        }
        panic!("not idle after {max_steps} steps");
    }

    pub(crate) fn check(&mut self) {
        self.s.check_invariants();
    }

    fn check_plan(&mut self, plan: &Plan) {
        let cfg = self.s.config().clone();
        assert!(plan.items.len() <= cfg.max_num_seqs, "too many items");
        assert!(
            plan.num_tokens() <= cfg.max_num_batched_tokens,
            "over budget"
        );
        if !plan.items.is_empty() {
            self.steps += 1;
        }
        let mut ids = BTreeSet::new();
        let mut written = BTreeMap::new();
        let mut read = Vec::new();
        for item in &plan.items {
            assert!(ids.insert(item.id), "{} twice in one plan", item.id);
            let t = self
                .reqs
                .get_mut(&item.id)
                .expect("planned request was submitted");
            assert!(
                t.end.is_none() && !t.cancelled,
                "{} planned after its end",
                item.id
            );
            t.first_planned_step.get_or_insert(self.steps);
            let full: Vec<u32> = t.prompt.iter().chain(&t.out).copied().collect();
            let (start, end) = (item.start_pos, item.start_pos + item.tokens.len());
            if plan.is_multi_step() {
                assert!(
                    item.tokens.len() == 1 && item.draft == 0 && item.sample.is_some(),
                    "{} is not a one-token decode in a multi-step plan",
                    item.id
                );
                assert!(
                    item.block_table.len() * self.bs >= start + plan.steps,
                    "{} table too short for {} steps",
                    item.id,
                    plan.steps
                );
            }
            // The positions the plan's steps write.
            let writes = end + plan.steps - 1;
            // Draft tokens are guesses after the known ones.
            let known = end - item.draft;
            assert!(!item.tokens.is_empty(), "empty item");
            assert!(known <= full.len(), "{} computes unknown tokens", item.id);
            assert_eq!(
                item.tokens[..item.tokens.len() - item.draft],
                full[start..known],
                "{} computes wrong tokens",
                item.id
            );
            assert_eq!(
                item.sample.is_some(),
                known == full.len(),
                "{} samples wrongly",
                item.id
            );
            assert!(
                item.draft == 0 || (item.sample.is_some() && known > start),
                "{} has a draft but no decode to verify it",
                item.id
            );
            let full: Vec<u32> = full
                .iter()
                .chain(&item.tokens[item.tokens.len() - item.draft..])
                .copied()
                .collect();
            assert!(
                item.block_table.len() * self.bs >= writes,
                "{} table too short",
                item.id
            );
            // Every earlier position must already hold this sequence's KV:
            // from its own earlier steps or from the prefix cache.
            let hashes = prefix_hashes(&full);
            for (p, h) in hashes.iter().enumerate().take(start) {
                let slot = item.block_table[p / self.bs] as usize * self.bs + p % self.bs;
                assert_eq!(
                    self.kv[slot], *h,
                    "{} position {p} holds someone else's KV",
                    item.id
                );
            }
            for p in start..writes {
                let b = item.block_table[p / self.bs];
                let prev = written.insert(b, item.id);
                assert!(
                    prev.is_none_or(|o| o == item.id),
                    "block {b} written by two sequences"
                );
            }
            read.extend(
                item.block_table[..start.div_ceil(self.bs)]
                    .iter()
                    .map(|&b| (b, item.id)),
            );
        }
        for (b, id) in read {
            assert!(
                written.get(&b).is_none_or(|&w| w == id),
                "block {b} read by {id} while another writes it"
            );
        }
    }

    fn run_executor(&mut self, plan: &Plan, ran: usize) -> Vec<SeqOutput> {
        if plan.is_multi_step() {
            return plan
                .items
                .iter()
                .map(|item| self.run_steps(item, ran))
                .collect();
        }
        plan.items
            .iter()
            .map(|item| {
                let t = &self.reqs[&item.id];
                let mut full: Vec<u32> = t.prompt.iter().chain(&t.out).copied().collect();
                let known = item.start_pos + item.tokens.len() - item.draft;
                full.truncate(known);
                full.extend_from_slice(&item.tokens[item.tokens.len() - item.draft..]);
                let hashes = prefix_hashes(&full);
                for (p, &h) in hashes.iter().enumerate().skip(item.start_pos) {
                    let slot = item.block_table[p / self.bs] as usize * self.bs + p % self.bs;
                    self.kv[slot] = h;
                }
                let t = self.reqs.get_mut(&item.id).unwrap();
                t.computed += item.tokens.len();
                // The fake model's sample at each output position, as the
                // real executors draw them.
                let mut out = SeqOutput::default();
                flotilla_exec::sample_outputs(&item.seq_input(), &mut out, |d| Sampled {
                    token: tok(item.id, d.position as usize),
                    logprob: 0.0,
                    top: Vec::new(),
                });
                out
            })
            .collect()
    }

    /// `ran` decode steps of one item of a multi-step plan, each step's
    /// sample the next one's token, as the worker runs them.
    fn run_steps(&mut self, item: &crate::PlanItem, ran: usize) -> SeqOutput {
        let t = &self.reqs[&item.id];
        let start = item.start_pos;
        let mut full: Vec<u32> = t.prompt.iter().chain(&t.out).copied().collect();
        assert_eq!(
            full.len(),
            start + 1,
            "{} decodes from the wrong place",
            item.id
        );
        let mut out = SeqOutput::default();
        for k in 0..ran {
            let s = Sampled {
                token: tok(item.id, start + 1 + k),
                logprob: 0.0,
                top: Vec::new(),
            };
            full.push(s.token);
            if let Some(prev) = out.sampled.replace(s) {
                out.accepted.push(prev);
            }
        }
        let hashes = prefix_hashes(&full);
        for (p, &h) in hashes.iter().enumerate().skip(start).take(ran) {
            let slot = item.block_table[p / self.bs] as usize * self.bs + p % self.bs;
            self.kv[slot] = h;
        }
        self.reqs.get_mut(&item.id).unwrap().computed += ran;
        out
    }

    fn collect(&mut self) {
        let events: Vec<SchedEvent> = self.s.drain_events().collect();
        for ev in events {
            let id = ev.id();
            let t = self
                .reqs
                .get_mut(&id)
                .expect("event for a submitted request");
            assert!(!t.cancelled, "event for cancelled {id}: {ev:?}");
            assert!(t.end.is_none(), "event for {id} after its end: {ev:?}");
            match ev {
                SchedEvent::Token { token, .. } => {
                    let pos = t.prompt.len() + t.out.len();
                    assert_eq!(token.token, tok(id, pos), "{id}: token out of order");
                    t.out.push(token.token);
                }
                SchedEvent::Finished {
                    reason,
                    usage,
                    timings,
                    ..
                } => {
                    assert_eq!(usage.completion_tokens as usize, t.out.len());
                    assert_eq!(usage.prompt_tokens as usize, t.prompt.len());
                    assert_eq!(timings.output_tokens as usize, t.out.len());
                    match reason {
                        FinishReason::Length => assert_eq!(t.out.len(), t.max_tokens as usize),
                        FinishReason::Stop if t.stopped_early => {}
                        FinishReason::Stop => {
                            let last = *t.out.last().expect("stopped on a token");
                            let model_stop = self.s.config().stop_tokens.contains(&last);
                            assert!(
                                t.stop_ids.contains(&last) || model_stop,
                                "{id} stopped on {last}"
                            );
                        }
                    }
                    t.end = Some(End::Finished(reason, usage, *timings));
                }
                SchedEvent::Failed { failure, .. } => t.end = Some(End::Failed(failure)),
                SchedEvent::Preempted { .. } => {
                    t.preempted += 1;
                    self.preempt_log.push(id);
                }
            }
        }
    }

    /// Every accepted request ended exactly once or was cancelled, and every
    /// finished one produced exactly what it would have alone.
    pub(crate) fn assert_all_done(&mut self) {
        assert!(self.s.is_idle());
        for (id, t) in &self.reqs {
            assert!(
                t.cancelled ^ t.end.is_some(),
                "{id} neither ended nor cancelled"
            );
            if let Some(End::Finished(..)) = &t.end {
                let alone: Vec<u32> = (0..t.out.len())
                    .map(|k| tok(*id, t.prompt.len() + k))
                    .collect();
                assert_eq!(t.out, alone, "{id} output differs from running alone");
            }
        }
        let u = self.s.kv_usage();
        assert_eq!(u.used, 0, "blocks still held: {u:?}");
        self.check();
    }

    /// Output tokens generated so far by a tenant's requests.
    pub(crate) fn tenant_tokens(&self, tenant: usize) -> usize {
        self.reqs
            .values()
            .filter(|t| t.tenant == tenant)
            .map(|t| t.out.len())
            .sum()
    }
}
