//! Tier queues, fair share, admission, continuous batching plan, chunked
//! prefill, preemption (pure logic).
//!
//! The [`Scheduler`] of one engine is a state machine driven by its actor
//! shell: `submit` and `cancel` as requests come and go, then per step
//! `schedule` (a [`Plan`] for the executor), the executor's results back
//! through `complete` (or `fail_step`), and `drain_events` for what to send
//! to clients; `expire` whenever a queue deadline passes (even mid-step), and
//! `fail_all` once no step can run any more. Time comes in as `now`; nothing
//! here reads a clock.
//!
//! Every accepted request ends in exactly one terminal event (`Finished` or
//! `Failed`) unless it is cancelled, and every KV lease goes back to the pool
//! on every path.

mod admission;
mod config;
mod cost;
mod event;
mod fair;
mod invariants;
mod migrate;
mod plan;
mod seq;
mod spec;
mod step;

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use flotilla_kv::{BlockPool, Lease, Owner};
use flotilla_proto::{
    EngineFailure, EngineStatus, FinishReason, KvOffload, KvUsage, RequestId, TierStatus, Usage,
};

pub use config::{
    Batching, ConfigError, DECODE_STEPS_MAX, DRAFT_P_MIN, SELF_LAYERS_DEFAULT, SchedConfig,
    Speculation, TenantConfig, TierConfig,
};
pub use cost::{CostLine, StepCost, best_draft, draft_gain};
pub use event::{Counters, SchedEvent, Timings};
pub use plan::{PROTECT_LINGER, Plan, PlanItem};

use fair::Vtc;
use flotilla_exec::rate::RateLimit;
use migrate::{HeldKv, Reservation};
use seq::Seq;

/// The scheduler of one engine: owns its queues, its running batch and its KV pool.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedConfig,
    pool: BlockPool,
    /// Every accepted request not yet ended; ordered, so iteration is deterministic.
    seqs: BTreeMap<RequestId, Seq>,
    /// The running batch in admission order (oldest first).
    running: Vec<RequestId>,
    /// Waiting requests per tenant; preempted ones go to the front.
    waiting: Vec<VecDeque<RequestId>>,
    /// Tenants of each tier.
    tier_tenants: Vec<Vec<usize>>,
    tier_queued: Vec<usize>,
    tier_running: Vec<usize>,
    /// Queued plus running per tenant (`max_concurrent`, VTC activity).
    tenant_live: Vec<u32>,
    /// Queue deadlines of requests never scheduled yet.
    deadlines: BTreeSet<(Duration, RequestId)>,
    rate: Vec<Option<RateLimit>>,
    tier_vtc: Vtc,
    tenant_vtc: Vtc,
    /// Admissions so far; a running sequence's `admit_seq` orders it by age.
    admissions: u64,
    next_step: u64,
    /// Steps handed out and not yet completed or failed, oldest first.
    in_flight: Vec<u64>,
    /// Sequences in those steps: no other plan takes or preempts them.
    busy: BTreeSet<RequestId>,
    /// The steps of the multi-step plan in flight, if one is (once it is
    /// cut, the steps its worker began: [`Scheduler::cut_in_flight`]).
    multi_step: Option<usize>,
    /// Most steps in flight at once (see [`Scheduler::set_depth`]).
    depth: usize,
    events: Vec<SchedEvent>,
    counters: Counters,
    /// Reused list of running ids, so planning allocates no id list per step.
    scratch: Vec<RequestId>,
    /// Where the next step's less protected decodes start under a latency
    /// budget (they take turns).
    lower_cursor: usize,
    /// The latency budget of the last step that had protected work, until
    /// when it lingers, and the tiers below it.
    protect_linger: Option<(Duration, usize, Vec<bool>)>,
    /// What steps cost on this engine, from the ones it ran (time targets).
    step_cost: StepCost,
    /// What a draft model's pass costs (speculative decoding with a draft
    /// model), from the passes the worker ran.
    draft_cost: StepCost,
    /// The draft model's acceptance so far, decayed: tokens accepted and
    /// drafts cut short by a rejection (a geometric fit's counts).
    draft_accept: (f64, f64),
    /// Blocks of finished prefills kept for export to a decode node.
    held: BTreeMap<RequestId, HeldKv>,
    /// Blocks reserved for KV a prefill node is about to send.
    reservations: BTreeMap<RequestId, Reservation>,
    /// When held blocks and reservations go back by themselves.
    kv_deadlines: BTreeSet<(Duration, RequestId)>,
    /// Compiles requests' output constraints; without one, a constrained
    /// request is refused.
    constraints: Option<std::sync::Arc<dyn flotilla_exec::ConstraintCompiler>>,
}

/// The draft model's acceptance before any draft was verified: 0.7 per
/// token (what a draft of the same family reaches on code), worth three
/// drafts' evidence.
pub const DRAFT_ACCEPT_PRIOR: (f64, f64) = (2.1, 0.9);
/// A draft model drafts only where the cost sum predicts at least this
/// gain: the fit's error is not worth a loss.
pub const DRAFT_MARGIN: f64 = 0.03;
/// The engine's acceptance counts as this many of a sequence's own
/// guesses until it has some: a sequence's text soon says how guessable it
/// is (with the step and draft costs measured for Qwen2.5-Coder 1.5B and
/// 0.5B on two cores, two rejections in a row turn a sequence's drafts
/// off where the engine's guesses were right nine times in ten).
pub const DRAFT_PRIOR_TRIALS: f64 = 4.0;

impl Scheduler {
    /// Validates `cfg` and builds the KV pool with every block free.
    pub fn new(cfg: SchedConfig) -> Result<Self, ConfigError> {
        cfg.validate()?;
        let pool = BlockPool::new(cfg.pool_config())?;
        let ntiers = cfg.tiers.len();
        let ntenants = cfg.tenants.len();
        let mut tier_tenants = vec![Vec::new(); ntiers];
        for (i, t) in cfg.tenants.iter().enumerate() {
            tier_tenants[usize::from(t.tier.0)].push(i);
        }
        let tier_vtc = Vtc::new(
            cfg.tiers.iter().map(|t| t.weight).collect(),
            vec![0; ntiers],
        );
        let tenant_vtc = Vtc::new(
            cfg.tenants.iter().map(|t| t.weight).collect(),
            cfg.tenants.iter().map(|t| usize::from(t.tier.0)).collect(),
        );
        let rate = cfg
            .tenants
            .iter()
            .map(|t| t.requests_per_minute.map(RateLimit::new))
            .collect();
        Ok(Scheduler {
            pool,
            seqs: BTreeMap::new(),
            running: Vec::with_capacity(cfg.max_num_seqs),
            waiting: vec![VecDeque::new(); ntenants],
            tier_tenants,
            tier_queued: vec![0; ntiers],
            tier_running: vec![0; ntiers],
            tenant_live: vec![0; ntenants],
            deadlines: BTreeSet::new(),
            rate,
            tier_vtc,
            tenant_vtc,
            admissions: 0,
            next_step: 0,
            in_flight: Vec::new(),
            busy: BTreeSet::new(),
            multi_step: None,
            depth: 1,
            events: Vec::new(),
            counters: Counters::default(),
            scratch: Vec::with_capacity(cfg.max_num_seqs),
            lower_cursor: 0,
            protect_linger: None,
            step_cost: StepCost::default(),
            draft_cost: StepCost::default(),
            draft_accept: DRAFT_ACCEPT_PRIOR,
            held: BTreeMap::new(),
            reservations: BTreeMap::new(),
            kv_deadlines: BTreeSet::new(),
            constraints: None,
            cfg,
        })
    }

    /// Lets up to `depth` steps be in flight at once, each over sequences
    /// the others do not hold: an executor whose stages work on different
    /// steps at the same time (a pipeline group) is kept full. Each plan
    /// then takes its share of the sequences; multi-step plans are off.
    pub fn set_depth(&mut self, depth: usize) {
        assert!(
            self.in_flight.is_empty(),
            "the depth changes only with no step in flight"
        );
        self.depth = depth.max(1);
    }

    /// Forgets every cached prefix (and the offload tier's copies): the
    /// executor's blocks lost their contents (a pipeline group formed
    /// again).
    pub fn clear_prefix_cache(&mut self) {
        self.pool.clear_cache();
    }

    /// Steps in flight now.
    pub fn num_in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Whether another plan may be handed out now.
    pub fn may_plan(&self) -> bool {
        self.in_flight.len() < self.depth
    }

    /// The validated config.
    pub fn config(&self) -> &SchedConfig {
        &self.cfg
    }

    /// Events since the last drain, in order.
    pub fn drain_events(&mut self) -> std::vec::Drain<'_, SchedEvent> {
        self.events.drain(..)
    }

    /// The multi-step plan in flight was cut after its worker began
    /// `begun` of its steps (it begins no more): the blocks only its later
    /// steps would have written go back now, not at its end, so that what
    /// comes next (a KV reservation, an admission) sees the pool as it
    /// would be after one-step plans. Nothing without such a plan.
    pub fn cut_in_flight(&mut self, begun: usize) {
        let Some(planned) = self.multi_step else {
            return;
        };
        let steps = begun.clamp(1, planned);
        self.multi_step = Some(steps);
        for id in self.running.iter().filter(|id| self.busy.contains(id)) {
            let seq = self.seqs.get_mut(id).expect("running sequence exists");
            let lease = seq.lease.as_mut().expect("running sequence has a lease");
            // Step k writes position num_computed + k - 1.
            self.pool.truncate(lease, seq.num_computed + steps);
        }
    }

    /// Blocks the multi-step plan in flight holds for its steps after the
    /// first `begun` (none without such a plan): a status reports them
    /// free, as one-step plans would have them.
    pub fn blocks_ahead(&self, begun: usize) -> u32 {
        let Some(planned) = self.multi_step else {
            return 0;
        };
        let steps = begun.clamp(1, planned);
        let bs = self.cfg.block_size as usize;
        self.running
            .iter()
            .filter(|id| self.busy.contains(id))
            .filter_map(|id| {
                let seq = &self.seqs[id];
                let held = seq.lease.as_ref()?.blocks().len();
                Some(held.saturating_sub((seq.num_computed + steps).div_ceil(bs)) as u32)
            })
            .sum()
    }

    /// What `/ready` reports.
    pub fn status(&mut self) -> EngineStatus {
        let u = self.pool.usage();
        EngineStatus {
            ready: true,
            steps: self.counters.steps,
            running: self.running.len(),
            tiers: self
                .cfg
                .tiers
                .iter()
                .enumerate()
                .map(|(i, t)| TierStatus {
                    name: t.name.clone(),
                    queued: self.tier_queued[i],
                    running: self.tier_running[i],
                })
                .collect(),
            kv: KvUsage {
                total: u.total,
                free: u.free,
                used: u.used,
                cached: u.cached,
                held: self
                    .held
                    .values()
                    .map(|h| h.lease.blocks().len() as u32)
                    .sum(),
                reserved: self
                    .reservations
                    .values()
                    .map(|r| r.lease.blocks().len() as u32)
                    .sum(),

                // The scheduler counts blocks; the engine, which owns the
                // executor, names their element type.
                dtype: Default::default(),
                offload: {
                    let o = self.pool.offload_stats();
                    KvOffload {
                        total: o.slots,
                        held: o.held,
                        spilled: o.spilled,
                        restored: o.restored,
                        dropped: o.dropped,
                        lookups: o.lookups,
                        hits: o.hits,
                        active: self.pool.offload_pays(),
                        // The engine, which measures them, fills these in.
                        move_ns: 0,
                        recompute_ns: 0,
                    }
                },
            },
            preemptions: self.counters.preemptions,
            orphans: 0,
            draining: false,
            nodes: Vec::new(),
            routing: Default::default(),
        }
    }

    /// What the prefix cache registered and dropped since the last call
    /// (or, `full`, its contents): what this engine's node tells its
    /// Routers, whose prefix indexes follow it.
    pub fn take_prefix_changes(&mut self) -> flotilla_proto::PrefixChanges {
        let d = self.pool.take_prefix_changes();
        flotilla_proto::PrefixChanges {
            full: d.full,
            stored: d.stored,
            removed: d.removed,
        }
    }

    /// Every block hash the prefix cache holds: a Router's starting point
    /// (the change log is left as it is, for the other Routers).
    pub fn prefix_snapshot(&mut self) -> flotilla_proto::PrefixChanges {
        flotilla_proto::PrefixChanges {
            full: true,
            stored: self.pool.prefix_snapshot(),
            removed: Vec::new(),
        }
    }

    /// Totals since start.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// KV occupancy now.
    pub fn kv_usage(&mut self) -> flotilla_kv::Usage {
        self.pool.usage()
    }

    /// The offload tier's occupancy and counters.
    pub fn offload_stats(&mut self) -> flotilla_kv::OffloadStats {
        self.pool.offload_stats()
    }

    /// Block moves between the KV tiers decided since the last call, in
    /// order: the engine has the executor perform them before the next
    /// step, block read or block write it sends.
    pub fn take_block_moves(&mut self) -> Vec<flotilla_kv::BlockMove> {
        self.pool.take_moves()
    }

    /// Whether block moves wait to be taken.
    pub fn has_block_moves(&self) -> bool {
        self.pool.has_moves()
    }

    /// Whether the offload tier pays (the engine's measured copy cost of a
    /// block against recomputing its tokens); while it does not, evicted
    /// blocks are dropped and spilled ones count as misses.
    pub fn set_offload_pays(&mut self, pays: bool) {
        self.pool.set_offload_pays(pays);
    }

    /// Nothing queued or running, and no blocks held or reserved.
    pub fn is_idle(&self) -> bool {
        self.seqs.is_empty() && self.held.is_empty() && self.reservations.is_empty()
    }

    /// Teaches the step cost model one finished step: `plan` ran in
    /// `elapsed` of the executor's time (without KV moves). The time
    /// targets (`step_time_max`, a tier's) size later steps from it.
    pub fn observe_step(&mut self, plan: &Plan, elapsed: Duration) {
        let outputs = plan
            .items
            .iter()
            .filter(|i| i.sample.is_some())
            .map(|i| 1 + i.draft)
            .sum();
        self.step_cost.observe(plan.num_tokens(), outputs, elapsed);
    }

    /// Teaches the draft model's cost one pass the worker ran: `tokens`
    /// positions (catch-up included), `rows` sequences, in `elapsed`.
    pub fn observe_draft(&mut self, tokens: usize, rows: usize, elapsed: Duration) {
        self.draft_cost.observe(tokens, rows, elapsed);
    }

    /// The draft model's per-token acceptance so far (a prior of
    /// [`DRAFT_ACCEPT_PRIOR`] before any draft was verified).
    pub fn draft_acceptance(&self) -> f64 {
        let (acc, cut) = self.draft_accept;
        acc / (acc + cut).max(1e-9)
    }

    /// What the cost sum says a step of `decodes` decodes should draft with
    /// the draft model, and the gain it predicts (tokens per second against
    /// no draft), at the engine's acceptance: `None` until both costs are
    /// measured.
    pub fn draft_plan(&self, decodes: usize) -> Option<(usize, f64)> {
        self.draft_plan_at(self.draft_acceptance(), decodes)
    }

    /// [`Scheduler::draft_plan`] at acceptance `alpha`.
    pub(crate) fn draft_plan_at(&self, alpha: f64, decodes: usize) -> Option<(usize, f64)> {
        let (t, d) = (self.step_cost.line()?, self.draft_cost.line()?);
        let max = self.cfg.speculation.max_draft;
        Some(best_draft(&t, &d, alpha, decodes, max, DRAFT_MARGIN))
    }

    /// The draft model's cost fitted so far.
    pub fn draft_cost(&self) -> Option<CostLine> {
        self.draft_cost.line()
    }

    /// The step cost fitted so far (`None` before a few steps ran).
    pub fn step_cost(&self) -> Option<CostLine> {
        self.step_cost.line()
    }

    /// Requests queued (preempted ones included).
    pub fn num_waiting(&self) -> usize {
        self.tier_queued.iter().sum()
    }

    /// Sequences in the running batch.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// The earliest queue deadline, so a shell knows when to call `expire`.
    pub fn next_deadline(&self) -> Option<Duration> {
        let queue = self.deadlines.first().map(|&(d, _)| d);
        let kv = self.kv_deadlines.first().map(|&(d, _)| d);
        match (queue, kv) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The pool owner of a sequence.
    fn owner_of(seq: &Seq) -> Owner {
        Owner {
            tenant: seq.tenant as u32,
            tier: seq.tier as u8,
        }
    }

    /// Takes a request out of every structure and returns its lease to the pool.
    fn remove_seq(&mut self, id: RequestId) -> Seq {
        let (seq, lease) = self.take_seq(id);
        if let Some(lease) = lease {
            self.pool.free(lease);
        }
        seq
    }

    /// Takes a request out of every structure; returns it with its lease
    /// (running) or its parked lease (imported, waiting for a seat).
    fn take_seq(&mut self, id: RequestId) -> (Seq, Option<Lease>) {
        let mut seq = self.seqs.remove(&id).expect("removing an unknown request");
        let lease = if let Some(lease) = seq.lease.take() {
            let pos = self.running.iter().position(|&r| r == id);
            self.running
                .remove(pos.expect("a leased sequence is in the running batch"));
            self.tier_running[seq.tier] -= 1;
            Some(lease)
        } else {
            let q = &mut self.waiting[seq.tenant];
            let pos = q.iter().position(|&r| r == id);
            q.remove(pos.expect("a sequence without a lease is waiting"));
            self.tier_queued[seq.tier] -= 1;
            if let Some(d) = seq.deadline {
                assert!(self.deadlines.remove(&(d, id)), "deadline not indexed");
            }
            seq.parked.take()
        };
        assert!(self.tenant_live[seq.tenant] > 0);
        self.tenant_live[seq.tenant] -= 1;
        (seq, lease)
    }

    /// Ends a request normally: emits `Finished`, frees its lease (or holds
    /// it for export, if it was submitted with `submit_held`).
    fn finish(&mut self, now: Duration, id: RequestId, reason: FinishReason) {
        let (seq, lease) = self.take_seq(id);
        match (lease, seq.hold_for) {
            (Some(lease), Some(hold)) => {
                self.hold(now, id, lease, seq.num_computed, hold);
            }
            (Some(lease), _) => self.pool.free(lease),
            (None, _) => {}
        }
        let usage = Usage {
            prompt_tokens: seq.prompt_len as u32,
            completion_tokens: seq.generated() as u32,
            cached_tokens: seq.cached_tokens.unwrap_or(0),
        };
        self.counters.finished += 1;
        self.events.push(SchedEvent::Finished {
            id,
            reason,
            usage,
            timings: Box::new(seq.timings(now)),
        });
    }

    /// Ends a request with a failure: emits `Failed`, frees its lease.
    fn fail(&mut self, now: Duration, id: RequestId, failure: EngineFailure) {
        let seq = self.remove_seq(id);
        self.counters.failed += 1;
        self.events.push(SchedEvent::Failed {
            id,
            failure,
            timings: Box::new(seq.timings(now)),
        });
    }

    /// Fails every queued request whose deadline is at or before `now`.
    ///
    /// Only requests never scheduled have a deadline: they hold no lease and
    /// are in no plan, so this is safe while a step is in flight (`schedule`
    /// also calls it).
    pub fn expire(&mut self, now: Duration) {
        self.expire_kv(now);
        while let Some(&(deadline, id)) = self.deadlines.first() {
            if deadline > now {
                break;
            }
            let waited = now.saturating_sub(self.seqs[&id].arrival);
            let failure = EngineFailure::QueueTimeout {
                waited_ms: waited.as_millis() as u64,
                limit_ms: self.cfg.queue_timeout.as_millis() as u64,
            };
            self.fail(now, id, failure);
        }
    }

    /// Ends every queued and running request with `Failed(failure)` and
    /// returns every lease, for an engine that can run no more steps.
    ///
    /// The step in flight, if any, is abandoned: its results must not be
    /// passed to `complete` or `fail_step` afterwards.
    pub fn fail_all(&mut self, now: Duration, failure: EngineFailure) {
        self.in_flight.clear();
        self.busy.clear();
        self.multi_step = None;
        let ids: Vec<RequestId> = self.seqs.keys().copied().collect();
        for id in ids {
            self.fail(now, id, failure.clone());
        }
        self.release_all_kv();
        assert!(self.running.is_empty() && self.deadlines.is_empty());
    }
}
