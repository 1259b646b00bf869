//! The Scheduler actor and the `LocalEngine` handle the Router holds.
//!
//! The loop: every message (a submission, a cancel, a finished step, a
//! deadline wake-up) updates the scheduler state machine; then, if the
//! worker is idle, the actor asks the state machine for the next plan and
//! sends it to the worker. So at most one step is in flight and a new
//! request joins the batch at the next step boundary.
//!
//! The GpuWorker is linked to the Scheduler actor: if it dies, or reports
//! its executor broken, every queued and running request fails at once and
//! new ones are refused, rather than waiting for a step that never comes.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use flotilla_engine::{BoxFuture, Engine, EventSink, KvMigration, RequestStream};
use flotilla_exec::{Executor, KvDtype};
use flotilla_proto::{
    EngineEvent, EngineFailure, EngineRequest, EngineStatus, KvExport, KvLayout, PrefixChanges,
    Rejection, RequestId, Sampled, StepEvents, TenantId, TierId,
};
use flotilla_sched::{SchedConfig, SchedEvent, Scheduler, Timings};
use flotilla_telemetry::{Metrics, PhaseTimes, Terminal, Tracing};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use tokio::sync::mpsc;

use crate::Clock;
use crate::msg::{PendingImport, SchedMsg, StepResult, WorkerMsg};
use crate::trace::{End, Entry, Traces};
use crate::worker::{GpuWorker, Offload, WorkerArgs};

/// Messages between two full invariant checks (see
/// [`EngineOptions::check_invariants`]).
pub const FULL_CHECK_EVERY: u64 = 64;

/// Told what broke when a checked engine's scheduler invariants fail.
pub type InvariantHook = Arc<dyn Fn(String) + Send + Sync>;

/// How to build an engine.
pub struct EngineOptions {
    /// The scheduler's configuration (tiers, tenants, limits, pool size).
    pub sched: SchedConfig,
    /// Check the KV accounting (free + leased + cached = total) after
    /// every message the Scheduler handles, each step's completion
    /// included, and every scheduler invariant (each block's holders,
    /// leases, queues, seats, deadlines: a pass over the whole pool) after
    /// every [`FULL_CHECK_EVERY`]th; report the first broken one here. For
    /// tests and the simulator, `None` in service.
    pub check_invariants: Option<InvariantHook>,
    /// Compiles requests' output constraints (structured output); `None`
    /// refuses constrained requests.
    pub constraints: Option<Arc<dyn flotilla_exec::ConstraintCompiler>>,
    /// A file to hold the KV offload tier (`sched.offload_blocks` slots),
    /// mapped into memory; `None`: host memory.
    pub offload_path: Option<std::path::PathBuf>,
    /// Exports the spans of traced requests (those whose
    /// `EngineRequest::trace` is set); `None`: tracing is off and nothing
    /// is recorded. Its clock must be the engine's.
    pub tracing: Option<Tracing>,
    /// The draft model of speculative decoding (`Speculation::draft_model`),
    /// held by the GpuWorker beside `exec`: its KV cache has `exec`'s blocks
    /// (the same count and tokens per block, its own bytes per block, which
    /// the pool's size must already count). Refused where its vocabulary
    /// differs from the model's. `None`: no draft model (model drafts off).
    pub draft: Option<Box<dyn Executor>>,
}

struct Live {
    out: LiveOut,
    tier: usize,
}

/// Where a live request's events go.
enum LiveOut {
    /// Its own stream, event by event.
    Stream(mpsc::UnboundedSender<EngineEvent>),
    /// A sink, with the other events of the same step.
    Sink(EventSink),
}

/// Events gathered per sink while one step's events are delivered.
#[derive(Default)]
struct SinkBatches(Vec<(EventSink, StepEvents)>);

impl SinkBatches {
    fn push(&mut self, sink: &EventSink, id: RequestId, ev: EngineEvent) {
        match self.0.iter_mut().find(|(s, _)| s.same_channel(sink)) {
            Some((_, b)) => b.push((id, ev)),
            None => self.0.push((sink.clone(), vec![(id, ev)])),
        }
    }

    fn flush(&mut self) {
        for (sink, b) in self.0.drain(..) {
            let _ = sink.send(b);
        }
    }
}

impl Live {
    /// Sends one event (a sink's waits in `batches` for the step's end).
    fn send(&self, id: RequestId, ev: EngineEvent, batches: &mut SinkBatches) {
        match &self.out {
            LiveOut::Stream(tx) => {
                let _ = tx.send(ev);
            }
            LiveOut::Sink(sink) => batches.push(sink, id, ev),
        }
    }
}

struct SchedulerActor;

/// A traced request's fields, taken at submission.
struct TraceHead {
    parent: flotilla_proto::TraceContext,
    tenant: u32,
    prompt_tokens: u32,
    max_tokens: u32,
}

struct SchedState {
    sched: Scheduler,
    worker: ActorRef<WorkerMsg>,
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
    tier_names: Vec<String>,
    tenant_tier: Vec<usize>,
    live: BTreeMap<RequestId, Live>,
    next_id: u64,
    /// A step is in flight.
    /// Steps sent to the worker and not yet answered.
    in_flight: usize,
    /// Most steps in flight (the executor's pipeline depth).
    depth: usize,
    /// A `TryRecover` is on its way (the worker broke).
    recovering: bool,
    /// Cut to end a multi-step plan in flight after the step in progress
    /// (`SchedConfig::decode_steps`): anything the Scheduler is told may
    /// change the next step. Reset when a plan is sent; it counts the
    /// steps the worker began, so a cut gives back at once the blocks of
    /// the steps that will not run.
    gate: Arc<crate::worker::PlanGate>,
    /// The earliest wake-up armed and not yet received.
    wake_at: Option<Duration>,
    /// The worker is alive and its executor trusted; once false, never true again.
    worker_ok: bool,
    events: Vec<SchedEvent>,
    /// Per-sink batches of the step being delivered (kept for reuse).
    batches: SinkBatches,
    /// Bytes of one KV block (import size checks).
    bytes_per_block: u64,
    /// Element type of the KV blocks (reported in the status).
    kv_dtype: KvDtype,
    /// Set while invariants are checked (none has broken yet).
    check: Option<InvariantHook>,
    /// Messages handled, for the full check's period.
    handled: u64,
    /// What a block's move between tiers and a token's recompute cost, as
    /// measured: whether the offload tier pays.
    offload_cost: OffloadCost,
    /// The tier's counters as last put in /metrics.
    offload_seen: flotilla_proto::KvOffload,
    tracing: Option<Tracing>,
    /// Timelines of the traced requests here.
    traces: Traces,
    /// Tokens generated per tier by the step being delivered (counted into
    /// the metrics once per step).
    generated: Vec<u64>,
}

/// Measured costs that decide whether the KV offload tier pays: a block
/// moved between tiers against its tokens recomputed by a prefill.
#[derive(Debug, Default)]
struct OffloadCost {
    /// Seconds per block moved (moving average).
    per_block: Option<f64>,
    /// Seconds per token of a prefill-sized step (moving average).
    per_token: Option<f64>,
}

impl OffloadCost {
    /// Steps of at least this many tokens measure the recompute cost (a
    /// step of a few decodes is bound by reading weights, not by tokens).
    const PREFILL_TOKENS: usize = 64;
    /// Weight of a new measurement.
    const ALPHA: f64 = 0.2;

    fn observe(&mut self, moved: u32, move_time: Duration, tokens: usize, elapsed: Duration) {
        let avg =
            |old: Option<f64>, new: f64| Some(old.map_or(new, |o| o + Self::ALPHA * (new - o)));
        if moved > 0 {
            self.per_block = avg(self.per_block, move_time.as_secs_f64() / f64::from(moved));
        }
        if tokens >= Self::PREFILL_TOKENS {
            let compute = elapsed.saturating_sub(move_time).as_secs_f64();
            self.per_token = avg(self.per_token, compute / tokens as f64);
        }
    }

    /// Whether a move costs less than recomputing a block's tokens; `None`
    /// until both are measured.
    fn pays(&self, block_size: u32) -> Option<bool> {
        Some(self.per_block? < self.per_token? * f64::from(block_size))
    }
}

struct SchedArgs {
    sched: Scheduler,
    exec: Box<dyn Executor>,
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
    tier_names: Vec<String>,
    tenant_tier: Vec<usize>,
    bytes_per_block: u64,
    kv_dtype: KvDtype,
    check: Option<InvariantHook>,
    offload: Option<Offload>,
    tracing: Option<Tracing>,
    draft: Option<crate::draft::DraftModel>,
}

impl Actor for SchedulerActor {
    type Msg = SchedMsg;
    type State = SchedState;
    type Arguments = SchedArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<SchedMsg>,
        a: SchedArgs,
    ) -> Result<SchedState, ActorProcessingErr> {
        let gate = Arc::new(crate::worker::PlanGate::default());
        let depth = a.exec.pipeline_depth().max(1);
        // Linked, so its death reaches `handle_supervisor_evt`.
        let (worker, _) = Actor::spawn_linked(
            None,
            GpuWorker,
            WorkerArgs {
                exec: a.exec,
                clock: a.clock.clone(),
                offload: a.offload,
                gate: gate.clone(),
                draft: a.draft,
            },
            myself.get_cell(),
        )
        .await?;
        let mut st = SchedState {
            sched: a.sched,
            worker,
            clock: a.clock,
            metrics: a.metrics,
            tier_names: a.tier_names,
            tenant_tier: a.tenant_tier,
            live: BTreeMap::new(),
            next_id: 1,
            in_flight: 0,
            depth,
            recovering: false,
            gate,
            wake_at: None,
            worker_ok: true,
            events: Vec::new(),
            batches: SinkBatches::default(),
            bytes_per_block: a.bytes_per_block,
            kv_dtype: a.kv_dtype,
            check: a.check,
            handled: 0,
            offload_cost: OffloadCost::default(),
            offload_seen: Default::default(),
            generated: Vec::new(),
            tracing: a.tracing,
            traces: Traces::default(),
        };
        // The pool's shape and occupancy show in /metrics from the start.
        record_load(&mut st);
        Ok(st)
    }

    async fn handle(
        &self,
        myself: ActorRef<SchedMsg>,
        msg: SchedMsg,
        st: &mut SchedState,
    ) -> Result<(), ActorProcessingErr> {
        let now = st.clock.now();
        // A question changes nothing; a step's end or a wake-up is the
        // plan's own business (or its deadline's, which only a request
        // waiting in a queue has, and none waits under a multi-step plan).
        if st.in_flight > 0
            && !matches!(
                msg,
                SchedMsg::StepDone(_)
                    | SchedMsg::Wake
                    | SchedMsg::Status(_)
                    | SchedMsg::KvHolders(_)
                    | SchedMsg::PrefixChanges { .. }
            )
        {
            // What the plan's later steps held goes back now.
            let begun = st.gate.cut();
            st.sched.cut_in_flight(begun);
        }
        match msg {
            SchedMsg::Submit { req, sink, reply } => {
                let answer = admit(&myself, st, now, req, sink, None);
                // The caller may have given up waiting; then the stream it
                // would have got is dropped here and cancels itself.
                let _ = reply.send(answer);
            }
            SchedMsg::SubmitHeld {
                req,
                hold_for,
                reply,
            } => {
                let _ = reply.send(admit(&myself, st, now, req, None, Some(hold_for)));
            }
            SchedMsg::Export { id, reply } => match st.sched.held_kv(id) {
                None => {
                    let _ = reply.send(Err(format!("no KV is held for {id}")));
                }
                Some((blocks, tokens)) => {
                    flush_moves(st);
                    let read = WorkerMsg::ReadBlocks {
                        blocks,
                        tokens: tokens as u32,
                        reply,
                    };
                    // A worker that is gone drops the reply port: the caller
                    // sees the export fail.
                    let _ = st.worker.cast(read);
                }
            },
            SchedMsg::Detach { id, hold, reply } => {
                let answer = st.sched.detach(now, id, hold);
                if answer.is_ok() {
                    st.traces.end(&st.tracing, id, End::Moved, now);
                }
                if answer.is_ok()
                    && let Some(l) = st.live.remove(&id)
                {
                    st.metrics
                        .request_ended(&st.tier_names[l.tier], Terminal::Moved);
                }
                let _ = reply.send(answer);
            }
            SchedMsg::Release { id, reply } => {
                let _ = reply.send(st.sched.release_held(id));
            }
            SchedMsg::Reserve {
                tenant,
                tokens,
                ttl,
                reply,
            } => {
                let id = RequestId(st.next_id);
                st.next_id += 1;
                let answer = if !st.worker_ok {
                    Err(Rejection::Unavailable)
                } else {
                    st.sched
                        .reserve(now, id, tenant, tokens as usize, ttl)
                        .map(|()| id)
                };
                let _ = reply.send(answer);
            }
            SchedMsg::CancelReservation { id, reply } => {
                let _ = reply.send(st.sched.cancel_reservation(id));
            }
            SchedMsg::Import(p, data) => start_import(&myself, st, p, data),
            SchedMsg::Imported(p, written) => finish_import(&myself, st, now, p, written),
            SchedMsg::Cancel(id) => {
                let live = st.live.remove(&id);
                st.traces.end(&st.tracing, id, End::Cancelled, now);
                if st.sched.cancel(now, id)
                    && let Some(l) = live
                {
                    st.metrics
                        .request_ended(&st.tier_names[l.tier], Terminal::Cancelled);
                }
            }
            // A step abandoned when the worker was lost: its requests have
            // already failed, and the state machine no longer expects it.
            SchedMsg::StepDone(_) if st.in_flight == 0 => {
                tracing::warn!("dropping the result of an abandoned step");
            }
            SchedMsg::StopString(id) => {
                // Finished (with usage and latencies) through the usual
                // event; `deliver` drops the live entry.
                st.sched.finish_early(now, id);
            }
            SchedMsg::StepDone(r) => step_done(st, now, *r),
            // `pump` below expires what is due and arms the next wake-up;
            // cleared even if it came early, so that one is armed again.
            SchedMsg::Wake => st.wake_at = None,
            // One attempt at a time: the next is armed when this one's
            // answer comes.
            SchedMsg::TryRecover => {
                if st.worker_ok || st.worker.cast(WorkerMsg::Recover(myself.clone())).is_err() {
                    st.recovering = false;
                }
            }
            SchedMsg::WorkerRecovered(back) => {
                st.recovering = false;
                if back && !st.worker_ok {
                    // Every block's contents are gone: no cached prefix
                    // may be offered again.
                    st.sched.clear_prefix_cache();
                    st.worker_ok = true;
                    tracing::info!("the worker runs steps again");
                }
            }
            SchedMsg::KvHolders(reply) => {
                let _ = reply.send(st.sched.kv_holders());
            }
            SchedMsg::PrefixChanges { snapshot, reply } => {
                let changes = if snapshot {
                    st.sched.prefix_snapshot()
                } else {
                    st.sched.take_prefix_changes()
                };
                let _ = reply.send(changes);
            }
            SchedMsg::DropOrphan { id, reply } => {
                let live = st.live.remove(&id);
                let dropped = st.sched.drop_orphan(now, id);
                st.traces.end(&st.tracing, id, End::Other("orphan"), now);
                if dropped && let Some(l) = live {
                    st.metrics
                        .request_ended(&st.tier_names[l.tier], Terminal::Cancelled);
                }
                let _ = reply.send(dropped);
            }
            SchedMsg::Status(reply) => {
                let _ = reply.send(status(st));
            }
        }
        pump(&myself, st, now);
        check_after(st);
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<SchedMsg>,
        evt: SupervisionEvent,
        st: &mut SchedState,
    ) -> Result<(), ActorProcessingErr> {
        let now = st.clock.now();
        let worker = st.worker.get_id();
        // Unlike ractor's default, the Scheduler outlives its worker: it
        // fails what it holds, then answers `Unavailable` and `/ready` false.
        match evt {
            SupervisionEvent::ActorFailed(who, err) if who.get_id() == worker => {
                tracing::error!(error = %err, "the GPU worker failed");
                worker_lost(st, now, format!("the GPU worker failed: {err}"));
            }
            SupervisionEvent::ActorTerminated(who, _, reason) if who.get_id() == worker => {
                tracing::error!(?reason, "the GPU worker stopped");
                worker_lost(st, now, "the GPU worker has stopped".into());
            }
            _ => {}
        }
        pump(&myself, st, now);
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<SchedMsg>,
        st: &mut SchedState,
    ) -> Result<(), ActorProcessingErr> {
        // Clients get a 503 they may retry elsewhere, not a stream cut short.
        let now = st.clock.now();
        st.sched.fail_all(now, EngineFailure::ShuttingDown);
        deliver(st, now);
        let mut batches = SinkBatches::default();
        for (id, l) in std::mem::take(&mut st.live) {
            l.send(
                id,
                EngineEvent::Failed(EngineFailure::ShuttingDown),
                &mut batches,
            );
        }
        batches.flush();
        st.worker.stop(None);
        Ok(())
    }
}

impl SchedState {
    /// What a traced request's timeline starts from, taken before the
    /// request moves into the scheduler; `None` when it is not traced
    /// here (no trace context, or tracing off).
    fn trace_head(&self, req: &EngineRequest) -> Option<TraceHead> {
        self.tracing.as_ref()?;
        Some(TraceHead {
            parent: req.trace.clone()?,
            tenant: req.tenant.0,
            prompt_tokens: req.prompt.len() as u32,
            max_tokens: req.max_tokens,
        })
    }

    fn trace_start(
        &mut self,
        id: RequestId,
        head: Option<TraceHead>,
        entry: Entry,
        tier: usize,
        now: Duration,
    ) {
        let Some(h) = head else { return };
        let tier = self.tier_names.get(tier).map_or("unknown", |s| s.as_str());
        self.traces.start(
            &self.tracing,
            id,
            Some(&h.parent),
            entry,
            tier,
            h.tenant,
            h.prompt_tokens,
            h.max_tokens,
            now,
        );
    }

    /// The tier index of a tenant (0 for an unknown one, which `submit` refuses).
    fn tier_of(&self, tenant: TenantId) -> usize {
        self.tenant_tier
            .get(tenant.0 as usize)
            .copied()
            .unwrap_or(0)
    }
}

/// The client's end of an accepted request: dropping it before the end
/// cancels the request; ending it at a stop string finishes it.
fn open_stream(
    myself: &ActorRef<SchedMsg>,
    st: &mut SchedState,
    id: RequestId,
    tier: usize,
    sink: Option<EventSink>,
) -> RequestStream {
    let me = myself.clone();
    let on_drop = Box::new(move |stop_string| {
        // After the end, or with the engine gone, there is nothing left
        // to cancel.
        let _ = me.cast(if stop_string {
            SchedMsg::StopString(id)
        } else {
            SchedMsg::Cancel(id)
        });
    });
    match sink {
        Some(sink) => {
            st.live.insert(
                id,
                Live {
                    out: LiveOut::Sink(sink),
                    tier,
                },
            );
            RequestStream::detached(id, on_drop)
        }
        None => {
            let (tx, rx) = mpsc::unbounded_channel();
            st.live.insert(
                id,
                Live {
                    out: LiveOut::Stream(tx),
                    tier,
                },
            );
            RequestStream::new(id, rx, on_drop)
        }
    }
}

/// Pins the reservation and sends its blocks to the worker to write; the
/// answer goes out when `Imported` comes back.
fn start_import(
    myself: &ActorRef<SchedMsg>,
    st: &mut SchedState,
    p: Box<PendingImport>,
    data: Vec<u8>,
) {
    let refuse = |st: &mut SchedState, p: Box<PendingImport>, why: Rejection| {
        st.sched.cancel_reservation(p.reservation);
        let _ = p.reply.send(Err(why));
    };
    if !st.worker_ok {
        return refuse(st, p, Rejection::Unavailable);
    }
    let size = (p.tokens, data.len() as u64, st.bytes_per_block);
    let blocks = match st
        .sched
        .start_import_sized(p.reservation, size.0, size.1, size.2)
    {
        Ok(b) => b,
        Err(e) => {
            let _ = p.reply.send(Err(Rejection::Invalid(e)));
            return;
        }
    };
    flush_moves(st);
    let write = WorkerMsg::WriteBlocks {
        blocks,
        data,
        pending: p,
        reply: myself.clone(),
    };
    if st.worker.cast(write).is_err() {
        // The pending reply went with the message: the caller sees the
        // import fail, and `worker_lost` gives every reservation back.
        let now = st.clock.now();
        worker_lost(st, now, "the GPU worker has stopped".into());
    }
}

/// Sends the worker the tier moves decided since the last message to it:
/// called before every block read or write, so that those (and the steps
/// after them) see the blocks where the pool says they are.
fn flush_moves(st: &mut SchedState) {
    if st.sched.has_block_moves() {
        // A worker that is gone fails everything at its next message.
        let _ = st
            .worker
            .cast(WorkerMsg::Moves(st.sched.take_block_moves()));
    }
}

/// Admits a request (or refuses it at once) and opens its stream: a whole
/// request, or with `hold_for` a prefill whose blocks stay held for a
/// decode node after it finishes.
fn admit(
    myself: &ActorRef<SchedMsg>,
    st: &mut SchedState,
    now: Duration,
    req: EngineRequest,
    sink: Option<EventSink>,
    hold_for: Option<Duration>,
) -> Result<RequestStream, Rejection> {
    let id = RequestId(st.next_id);
    st.next_id += 1;
    let tier = st.tier_of(req.tenant);
    if !st.worker_ok {
        return Err(Rejection::Unavailable);
    }
    let traced = st.trace_head(&req);
    let (admitted, entry) = match hold_for {
        None => (st.sched.submit(now, id, req), Entry::Whole),
        Some(hold) => (
            st.sched.submit_held(now, id, req, hold),
            Entry::PrefillForDecode,
        ),
    };
    admitted.map(|()| {
        st.trace_start(id, traced, entry, tier, now);
        open_stream(myself, st, id, tier, sink)
    })
}

/// An import's KV was written (or not): the reservation becomes a running
/// request with its first token, or goes back.
fn finish_import(
    myself: &ActorRef<SchedMsg>,
    st: &mut SchedState,
    now: Duration,
    p: Box<PendingImport>,
    written: Result<(), String>,
) {
    let PendingImport {
        reservation,
        req,
        first,
        sink,
        reply,
        ..
    } = *p;
    let answer = match written {
        Err(e) => {
            tracing::error!(error = %e, "writing imported KV failed");
            st.sched.cancel_reservation(reservation);
            Err(Rejection::Unavailable)
        }
        Ok(()) => {
            let tier = st.tier_of(req.tenant);
            let traced = st.trace_head(&req);
            // Live before the first token is delivered below.
            st.sched
                .submit_imported(now, reservation, req, first)
                .map(|()| {
                    st.trace_start(reservation, traced, Entry::Imported, tier, now);
                    open_stream(myself, st, reservation, tier, sink)
                })
        }
    };
    let _ = reply.send(answer);
}

/// A step's results: metrics and cost model first, then the state
/// machine (tokens, or the step's failure), then the worker's health.
fn step_done(st: &mut SchedState, now: Duration, r: StepResult) {
    let StepResult {
        plan,
        sampled,
        elapsed,
        ran,
        moved,
        move_time,
        worker_ok,
        lost,
        draft,
        draft_blocks,
    } = r;
    st.in_flight -= 1;
    st.traces.step_done(&plan.items, now);
    // A multi-step plan's steps count one by one, each its share
    // (tier moves run before the first).
    let ran = ran.max(1);
    let compute = elapsed.saturating_sub(move_time) / ran as u32;
    let each = compute + move_time;
    st.metrics.step_time(each.as_secs_f64());
    for _ in 1..ran {
        st.metrics.step_time(compute.as_secs_f64());
    }
    st.offload_cost
        .observe(moved, move_time, plan.num_tokens(), each);
    // The draft model's passes ran before the step, within its time:
    // each teaches the draft's cost, and the step's own is what is left.
    let mut drafting = Duration::ZERO;
    for p in &draft {
        st.sched.observe_draft(p.tokens, p.rows, p.time);
        drafting += p.time;
    }
    if !draft.is_empty() || draft_blocks.is_some() {
        let passes = draft.len() as u64;
        let tokens = draft.iter().map(|p| p.tokens as u64).sum();
        st.metrics
            .draft_model(passes, tokens, drafting.as_secs_f64(), draft_blocks);
    }
    if let Ok(outs) = &sampled {
        let verified = plan
            .items
            .iter()
            .zip(outs)
            .filter(|(i, o)| i.draft > 0 && o.sampled.is_some());
        st.metrics.verify_steps(verified.count() as u64);
    }
    let decodes = plan.items.iter().filter(|i| i.sample.is_some()).count();
    if let Some((k, gain)) = st
        .sched
        .config()
        .speculation
        .draft_model
        .then(|| st.sched.draft_plan(decodes))
        .flatten()
    {
        st.metrics
            .draft_prediction(st.sched.draft_acceptance(), k as u64, gain);
    }
    st.sched.observe_step(
        &plan,
        each.saturating_sub(move_time).saturating_sub(drafting),
    );
    if let Some(c) = st.sched.step_cost() {
        st.metrics.step_cost(c.fixed, c.per_token, c.per_output);
    }
    if let Some(pays) = st.offload_cost.pays(st.sched.config().block_size) {
        st.sched.set_offload_pays(pays);
    }
    let error = match sampled {
        Ok(s) => {
            st.sched.complete(now, &plan, &s);
            None
        }
        Err(e) => {
            tracing::error!(error = %e, "step failed");
            if lost {
                // A part of the engine is lost, not the request: the
                // Router moves it.
                st.sched
                    .fail_step_with(now, &plan, EngineFailure::EngineLost(e.clone()));
            } else {
                // The step's own failure (a panic, or a device error the
                // request may have caused): not moved to break another.
                st.sched.fail_step(now, &plan, &e);
            }
            Some(e)
        }
    };
    if !worker_ok {
        let why = error.unwrap_or_else(|| "the GPU worker is broken".into());
        worker_lost(st, now, why);
    }
    record_load(st);
}

/// The engine's status as `/ready` and the heartbeats report it.
fn status(st: &mut SchedState) -> EngineStatus {
    let mut s = st.sched.status();
    // Blocks a multi-step plan holds for steps not begun yet count as free,
    // as one-step plans would have them.
    let ahead = st.sched.blocks_ahead(st.gate.begun());
    s.kv.free += ahead;
    s.kv.used = s.kv.used.saturating_sub(ahead);
    s.ready = st.worker_ok;
    s.kv.dtype = st.kv_dtype;
    if s.kv.offload.total > 0 {
        let ns = |secs: Option<f64>| secs.map_or(0, |v| (v * 1e9) as u64);
        let bs = f64::from(st.sched.config().block_size);
        s.kv.offload.move_ns = ns(st.offload_cost.per_block);
        s.kv.offload.recompute_ns = ns(st.offload_cost.per_token.map(|t| t * bs));
    }
    s
}

/// Under a check hook (the simulator), the scheduler's invariants after
/// a handled message: KV accounting every time, everything every
/// `FULL_CHECK_EVERY`; the first broken one is reported once.
fn check_after(st: &mut SchedState) {
    if let Some(hook) = st.check.clone() {
        st.handled += 1;
        let full = st.handled.is_multiple_of(FULL_CHECK_EVERY);
        let sched = &mut st.sched;
        let checked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            if full {
                sched.check_invariants()
            } else {
                sched.check_kv_accounting()
            }
        }));
        if let Err(p) = checked {
            let what = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "an invariant".into());
            hook(format!("scheduler invariant broken: {what}"));
            // Reported once; the state is suspect from here on.
            st.check = None;
        }
    }
}

/// How often a broken worker is asked to recover.
const RECOVER_EVERY: Duration = Duration::from_secs(1);

/// The worker can run no more steps: fail every request, the one in flight
/// included (its plan is abandoned), and refuse new ones from now on.
fn worker_lost(st: &mut SchedState, now: Duration, why: String) {
    st.worker_ok = false;
    st.in_flight = 0;
    st.sched.fail_all(now, EngineFailure::EngineLost(why));
}

/// Expires what is due, starts the next step if the worker is idle,
/// delivers the state machine's events and arms the next wake-up.
fn pump(myself: &ActorRef<SchedMsg>, st: &mut SchedState, now: Duration) {
    // Every time, not only when a plan is made: a deadline that passes while
    // a step is in flight must fail its request now, and stop being due.
    st.sched.expire(now);
    let mut masks = Vec::new();
    while st.in_flight < st.depth && st.worker_ok {
        let plan = st.sched.schedule(now);
        if plan.items.is_empty() {
            break;
        }
        st.in_flight += 1;
        st.gate.reset();
        st.traces.step_planned(&plan.items, now);
        masks.extend(plan.masks());
        if st
            .worker
            .cast(WorkerMsg::Step {
                plan,
                moves: st.sched.take_block_moves(),
                reply: myself.clone(),
            })
            .is_err()
        {
            // The worker is gone: fail everything rather than wait for
            // a reply that never comes.
            worker_lost(st, now, "the GPU worker has stopped".into());
            break;
        }
    }
    // A broken worker is asked to recover every second (a pipeline group
    // whose stage is back forms again; other backends never do).
    if !st.worker_ok && !st.recovering {
        st.recovering = true;
        myself.send_after(RECOVER_EVERY, || SchedMsg::TryRecover);
    }
    // A pipelined worker holds begun steps until `depth` are under way:
    // with no more to send now, it finishes the ones it has.
    if st.depth > 1 && st.in_flight > 0 && st.in_flight < st.depth {
        let _ = st.worker.cast(WorkerMsg::Flush);
    }
    // Moves decided with no step to carry them (an admission that gave its
    // blocks back, a reservation) go now: nothing may write those blocks
    // before them.
    flush_moves(st);
    deliver(st, now);
    // The step's constrained samples need their masks only once the
    // forward pass is done: computed beside it, they leave the step's
    // critical path (the executor computes any not done by then). Not on
    // this thread: the worker's task was just woken into this thread's
    // LIFO slot, which no other thread may steal, so work done here
    // delays the step instead of overlapping it. A current-thread runtime
    // (the simulator) runs nothing beside anything: there, now.
    if !masks.is_empty() {
        let compute = move || {
            for m in &masks {
                m.compute();
            }
        };
        if crate::on_multi_thread_runtime() {
            drop(tokio::task::spawn_blocking(compute));
        } else {
            compute();
        }
    }
    // After `expire` every deadline is in the future; arming one that is not
    // would send Wake after Wake until something else changed.
    if let Some(d) = st.sched.next_deadline()
        && d > now
        && st.wake_at.is_none_or(|w| d < w)
    {
        st.wake_at = Some(d);
        myself.send_after(d - now, || SchedMsg::Wake);
    }
}

fn deliver(st: &mut SchedState, now: Duration) {
    // Reuse one buffer: the state machine's event queue is borrowed while
    // draining, and delivery needs the rest of the state.
    let mut events = std::mem::take(&mut st.events);
    events.extend(st.sched.drain_events());
    // One message per sink for everything this step produced.
    let mut batches = std::mem::take(&mut st.batches);
    for ev in events.drain(..) {
        match ev {
            SchedEvent::Token { id, token } => {
                st.traces.token(id, now);
                if let Some(l) = st.live.get(&id) {
                    if st.generated.len() <= l.tier {
                        st.generated.resize(l.tier + 1, 0);
                    }
                    st.generated[l.tier] += 1;
                    l.send(id, EngineEvent::Token(token), &mut batches);
                }
            }
            SchedEvent::Finished {
                id,
                reason,
                usage,
                timings,
            } => {
                let tier = tier_name(&st.tier_names, timings.tier);
                st.metrics.record_phases(tier, &phases(&timings));
                // Generated tokens are counted as they come (below).
                st.metrics.tokens(
                    tier,
                    usage.prompt_tokens as u64,
                    0,
                    usage.cached_tokens as u64,
                );
                st.metrics
                    .speculation(tier, timings.drafted.into(), timings.accepted.into());
                st.metrics.request_ended(tier, Terminal::Finished);
                let end = End::Finished {
                    reason: reason.as_str(),
                    output_tokens: usage.completion_tokens,
                    cached_tokens: usage.cached_tokens,
                };
                st.traces.end(&st.tracing, id, end, now);
                if let Some(l) = st.live.remove(&id) {
                    l.send(id, EngineEvent::Finished { reason, usage }, &mut batches);
                }
            }
            SchedEvent::Failed {
                id,
                failure,
                timings,
            } => {
                let tier = tier_name(&st.tier_names, timings.tier);
                let state = match failure {
                    EngineFailure::QueueTimeout { .. } => Terminal::TimedOut,
                    _ => Terminal::Error,
                };
                st.metrics.request_ended(tier, state);
                if st.traces.has(id) {
                    st.traces
                        .end(&st.tracing, id, End::Failed(failure.to_string()), now);
                }
                if let Some(l) = st.live.remove(&id) {
                    l.send(id, EngineEvent::Failed(failure), &mut batches);
                }
            }
            SchedEvent::Preempted { id, tier } => {
                st.traces.preempted(id, now);
                st.metrics.preempted(tier_name(&st.tier_names, tier));
            }
        }
    }
    st.events = events;
    for (t, n) in st.generated.iter_mut().enumerate() {
        if *n > 0 {
            st.metrics
                .tokens(tier_name(&st.tier_names, TierId(t as u8)), 0, *n, 0);
            *n = 0;
        }
    }
    batches.flush();
    st.batches = batches;
}

/// The metrics label of a tier.
fn tier_name(names: &[String], tier: TierId) -> &str {
    names.get(tier.0 as usize).map_or("unknown", |s| s.as_str())
}

fn phases(t: &Timings) -> PhaseTimes {
    PhaseTimes {
        queue_s: t.queue.as_secs_f64(),
        prefill_s: t.prefill.as_secs_f64(),
        decode_s: t.decode.as_secs_f64(),
        ttft_s: t.ttft.map(|d| d.as_secs_f64()),
        tpot_s: t.tpot.map(|d| d.as_secs_f64()),
    }
}

fn record_load(st: &mut SchedState) {
    let s = st.sched.status();
    st.metrics
        .kv(s.kv.used as u64, s.kv.free as u64, s.kv.cached as u64);
    st.metrics
        .kv_cache(st.kv_dtype.name(), s.kv.total as u64, st.bytes_per_block);
    let (o, seen) = (s.kv.offload, st.offload_seen);
    if o.total > 0 {
        st.metrics.kv_offload(
            [o.held, o.total - o.held],
            [
                o.spilled - seen.spilled,
                o.restored - seen.restored,
                o.dropped - seen.dropped,
            ],
            [
                o.hits - seen.hits,
                (o.lookups - o.hits) - (seen.lookups - seen.hits),
            ],
        );
        st.offload_seen = o;
    }
    for t in &s.tiers {
        st.metrics
            .tier_load(&t.name, t.queued as u64, t.running as u64);
    }
}

/// The engine as the Router sees it: a handle to the Scheduler actor (which
/// owns the GpuWorker).
#[derive(Clone)]
pub struct LocalEngine {
    pub(crate) sched: ActorRef<SchedMsg>,
    /// The executor's KV block shape, for migration.
    layout: KvLayout,
}

impl std::fmt::Debug for LocalEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LocalEngine")
    }
}

/// Why an engine could not start.
#[derive(Debug, thiserror::Error)]
pub enum EngineStartError {
    /// The scheduler configuration is invalid.
    #[error("scheduler configuration: {0}")]
    Config(String),
    /// An actor failed to start.
    #[error("actor start: {0}")]
    Spawn(String),
}

/// Starts the Scheduler actor of one engine, which starts its GpuWorker.
pub async fn spawn_engine(
    mut exec: Box<dyn Executor>,
    opts: EngineOptions,
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
) -> Result<LocalEngine, EngineStartError> {
    let tier_names: Vec<String> = opts.sched.tiers.iter().map(|t| t.name.clone()).collect();
    let tenant_tier: Vec<usize> = opts
        .sched
        .tenants
        .iter()
        .map(|t| t.tier.0 as usize)
        .collect();
    let spec = exec.kv_spec();
    let layout = KvLayout {
        block_size: spec.block_size as u32,
        dtype: spec.dtype,
        layout: 1,
        layers: u16::try_from(exec.model_spec().n_layer).unwrap_or(u16::MAX),
        bytes_per_block: spec.bytes_per_block as u64,
    };
    let mut cfg = opts.sched;
    // The backend's output rows bound the draft tokens of a step.
    let most = exec.max_draft_tokens();
    if cfg.speculation.is_on() {
        if most == 0 {
            tracing::info!("this backend verifies no draft tokens: speculative decoding is off");
            cfg.speculation = flotilla_sched::Speculation::OFF;
        } else {
            cfg.speculation.max_draft = cfg.speculation.max_draft.min(most);
            cfg.speculation.max_step = cfg.speculation.max_step.min(most);
        }
        let n = exec.model_spec().n_layer;
        let asked = cfg.speculation.self_layers;
        if asked > 0 && !exec.can_self_draft() {
            tracing::info!("this backend has no self-draft: n-gram drafts only");
            cfg.speculation.self_layers = 0;
        } else if asked > 0 {
            let want = match asked {
                flotilla_sched::SELF_LAYERS_DEFAULT => (3 * n).div_ceil(4),
                l => l,
            };
            let layers = want.clamp(1, n.saturating_sub(1).max(1));
            if asked != flotilla_sched::SELF_LAYERS_DEFAULT && layers != asked {
                tracing::warn!(
                    asked,
                    layers,
                    "a self-draft runs 1 to {} layers of this model",
                    n - 1
                );
            }
            cfg.speculation.self_layers = layers;
        }
    }
    let draft = match opts.draft {
        Some(d) if cfg.speculation.is_on() && cfg.speculation.draft_model => {
            let (t, m) = (exec.model_spec(), d.model_spec());
            if t.vocab != m.vocab {
                return Err(EngineStartError::Config(format!(
                    "the draft model's vocabulary ({} tokens) differs from the model's ({} \
                     tokens): a draft model must share the model's tokenizer",
                    m.vocab, t.vocab
                )));
            }
            let (kt, kd) = (exec.kv_spec(), d.kv_spec());
            if kd.block_size != kt.block_size || kd.num_blocks < kt.num_blocks {
                return Err(EngineStartError::Config(format!(
                    "the draft model's KV cache ({} blocks of {} tokens) must have the \
                     model's blocks ({} of {} tokens)",
                    kd.num_blocks, kd.block_size, kt.num_blocks, kt.block_size
                )));
            }
            let most = cfg.max_num_batched_tokens.min(d.max_batch_tokens());
            Some(crate::draft::DraftModel::new(
                d,
                most,
                cfg.speculation.draft_p_min,
            ))
        }
        _ => {
            if cfg.speculation.draft_model {
                tracing::info!("no draft model: n-gram drafts only");
                cfg.speculation.draft_model = false;
            }
            None
        }
    };
    let offload = match cfg.offload_blocks {
        0 => None,
        // A file-backed tier stays with the worker; otherwise the backend
        // may keep the tier where it moves fastest.
        slots
            if opts.offload_path.is_none()
                && exec.attach_offload(slots).map_err(|e| {
                    EngineStartError::Config(format!("the KV offload tier: {e}"))
                })? =>
        {
            Some(Offload::Executor)
        }
        slots => Some(Offload::Host(
            flotilla_exec::OffloadTier::new(
                slots,
                exec.offload_bytes_per_block(),
                opts.offload_path.as_deref(),
            )
            .map_err(EngineStartError::Config)?,
        )),
    };
    let mut sched = Scheduler::new(cfg).map_err(|e| EngineStartError::Config(e.to_string()))?;
    // A pipeline group keeps a step in flight for each of its stages.
    sched.set_depth(exec.pipeline_depth());
    if let Some(c) = opts.constraints {
        sched.set_constraints(c);
    }
    let (sched, _) = Actor::spawn(
        None,
        SchedulerActor,
        SchedArgs {
            sched,
            exec,
            clock,
            metrics,
            tier_names,
            tenant_tier,
            bytes_per_block: layout.bytes_per_block,
            kv_dtype: spec.dtype,
            check: opts.check_invariants,
            offload,
            tracing: opts.tracing,
            draft,
        },
    )
    .await
    .map_err(|e| EngineStartError::Spawn(e.to_string()))?;
    Ok(LocalEngine { sched, layout })
}

impl LocalEngine {
    /// Stops both actors: queued and running requests fail with
    /// `ShuttingDown`, then the Scheduler stops its worker.
    pub fn stop(&self) {
        self.sched.stop(None);
    }
}

impl Engine for LocalEngine {
    fn submit(&self, req: EngineRequest) -> BoxFuture<Result<RequestStream, Rejection>> {
        let sched = self.sched.clone();
        Box::pin(async move {
            match sched
                .call(
                    |reply| SchedMsg::Submit {
                        req,
                        sink: None,
                        reply,
                    },
                    None,
                )
                .await
            {
                Ok(ractor::rpc::CallResult::Success(r)) => r,
                _ => Err(Rejection::Unavailable),
            }
        })
    }

    fn submit_to(
        &self,
        req: EngineRequest,
        sink: EventSink,
    ) -> BoxFuture<Result<RequestStream, Rejection>> {
        let sched = self.sched.clone();
        Box::pin(async move {
            let msg = |reply| SchedMsg::Submit {
                req,
                sink: Some(sink),
                reply,
            };
            ask(&sched, msg, Err(Rejection::Unavailable)).await
        })
    }

    fn status(&self) -> BoxFuture<EngineStatus> {
        let sched = self.sched.clone();
        Box::pin(async move {
            match sched.call(SchedMsg::Status, None).await {
                Ok(ractor::rpc::CallResult::Success(s)) => s,
                _ => EngineStatus::default(),
            }
        })
    }
}

/// The answer of a call to the Scheduler actor, or `gone` if it is not running.
async fn ask<T: Send + 'static>(
    sched: &ActorRef<SchedMsg>,
    msg: impl FnOnce(RpcReplyPort<T>) -> SchedMsg,
    gone: T,
) -> T {
    match sched.call(msg, None).await {
        Ok(ractor::rpc::CallResult::Success(r)) => r,
        _ => gone,
    }
}

impl KvMigration for LocalEngine {
    fn kv_layout(&self) -> KvLayout {
        self.layout.clone()
    }

    fn submit_for_export(
        &self,
        req: EngineRequest,
        hold_for: Duration,
    ) -> BoxFuture<Result<RequestStream, Rejection>> {
        let sched = self.sched.clone();
        Box::pin(async move {
            let msg = |reply| SchedMsg::SubmitHeld {
                req,
                hold_for,
                reply,
            };
            ask(&sched, msg, Err(Rejection::Unavailable)).await
        })
    }

    fn export_kv(&self, id: RequestId) -> BoxFuture<Result<KvExport, String>> {
        let sched = self.sched.clone();
        Box::pin(async move {
            let gone = Err("the engine stopped before the KV was read".to_string());
            ask(&sched, |reply| SchedMsg::Export { id, reply }, gone).await
        })
    }

    fn detach_kv(&self, id: RequestId, hold_for: Duration) -> BoxFuture<Result<Vec<u32>, String>> {
        let sched = self.sched.clone();
        Box::pin(async move {
            let gone = Err("the engine has stopped".to_string());
            ask(
                &sched,
                |reply| SchedMsg::Detach {
                    id,
                    hold: hold_for,
                    reply,
                },
                gone,
            )
            .await
        })
    }

    fn release_kv(&self, id: RequestId) -> BoxFuture<bool> {
        let sched = self.sched.clone();
        Box::pin(async move { ask(&sched, |reply| SchedMsg::Release { id, reply }, false).await })
    }

    fn reserve_kv(
        &self,
        tenant: TenantId,
        tokens: u32,
        ttl: Duration,
    ) -> BoxFuture<Result<RequestId, Rejection>> {
        let sched = self.sched.clone();
        Box::pin(async move {
            let msg = |reply| SchedMsg::Reserve {
                tenant,
                tokens,
                ttl,
                reply,
            };
            ask(&sched, msg, Err(Rejection::Unavailable)).await
        })
    }

    fn import_kv(
        &self,
        reservation: RequestId,
        tokens: u32,
        data: Vec<u8>,
        req: EngineRequest,
        first: Sampled,
        sink: Option<EventSink>,
    ) -> BoxFuture<Result<RequestStream, Rejection>> {
        let sched = self.sched.clone();
        Box::pin(async move {
            let msg = |reply| {
                let p = PendingImport {
                    reservation,
                    tokens,
                    req,
                    first,
                    sink,
                    reply,
                };
                SchedMsg::Import(Box::new(p), data)
            };
            ask(&sched, msg, Err(Rejection::Unavailable)).await
        })
    }

    fn cancel_reservation(&self, id: RequestId) -> BoxFuture<bool> {
        let sched = self.sched.clone();
        Box::pin(async move {
            ask(
                &sched,
                |reply| SchedMsg::CancelReservation { id, reply },
                false,
            )
            .await
        })
    }

    fn kv_holders(&self) -> BoxFuture<Vec<RequestId>> {
        let sched = self.sched.clone();
        Box::pin(async move { ask(&sched, SchedMsg::KvHolders, Vec::new()).await })
    }

    fn prefix_changes(&self, snapshot: bool) -> BoxFuture<Option<PrefixChanges>> {
        let sched = self.sched.clone();
        Box::pin(async move {
            // An engine that stopped answers with nothing to report.
            let none = PrefixChanges::default();
            let c = ask(
                &sched,
                |reply| SchedMsg::PrefixChanges { snapshot, reply },
                none,
            )
            .await;
            Some(c)
        })
    }

    fn drop_orphan(&self, id: RequestId) -> BoxFuture<bool> {
        let sched = self.sched.clone();
        Box::pin(
            async move { ask(&sched, |reply| SchedMsg::DropOrphan { id, reply }, false).await },
        )
    }
}
