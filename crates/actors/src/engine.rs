//! The Scheduler actor and the `LocalEngine` handle the Router holds.
//!
//! The loop: every message (a submission, a cancel, a finished step, a
//! deadline wake-up) updates the scheduler state machine; then, if the
//! worker is idle, the actor asks the state machine for the next plan and
//! sends it to the worker. So at most one step is in flight and a new
//! request joins the batch at the next step boundary.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use flotilla_model::Executor;
use flotilla_proto::{
    BoxFuture, Engine, EngineEvent, EngineFailure, EngineRequest, EngineStatus, Rejection,
    RequestId, RequestStream,
};
use flotilla_sched::{SchedConfig, SchedEvent, Scheduler, Timings};
use flotilla_telemetry::{Metrics, PhaseTimes, Terminal};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::sync::mpsc;

use crate::Clock;
use crate::worker::{GpuWorker, StepResult, WorkerArgs, WorkerMsg};

/// Messages of the Scheduler actor.
pub(crate) enum SchedMsg {
    /// Admit a request (or refuse it at once).
    Submit {
        req: EngineRequest,
        reply: RpcReplyPort<Result<RequestStream, Rejection>>,
    },
    /// The client went away: drop the request wherever it is.
    Cancel(RequestId),
    /// The worker finished a step.
    StepDone(Box<StepResult>),
    /// A queue deadline may have passed.
    Wake,
    /// Figures for `/ready`.
    Status(RpcReplyPort<EngineStatus>),
}

/// How to build an engine.
pub struct EngineOptions {
    /// The scheduler's configuration (tiers, tenants, limits, pool size).
    pub sched: SchedConfig,
}

struct Live {
    tx: mpsc::UnboundedSender<EngineEvent>,
    tier: usize,
}

struct SchedulerActor;

struct SchedState {
    sched: Scheduler,
    worker: ActorRef<WorkerMsg>,
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
    tier_names: Vec<String>,
    tenant_tier: Vec<usize>,
    live: HashMap<RequestId, Live>,
    next_id: u64,
    /// A step is in flight.
    busy: bool,
    /// The earliest wake-up already armed.
    wake_at: Option<Duration>,
    worker_ok: bool,
    events: Vec<SchedEvent>,
}

struct SchedArgs {
    sched: Scheduler,
    worker: ActorRef<WorkerMsg>,
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
    tier_names: Vec<String>,
    tenant_tier: Vec<usize>,
}

impl Actor for SchedulerActor {
    type Msg = SchedMsg;
    type State = SchedState;
    type Arguments = SchedArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<SchedMsg>,
        a: SchedArgs,
    ) -> Result<SchedState, ActorProcessingErr> {
        Ok(SchedState {
            sched: a.sched,
            worker: a.worker,
            clock: a.clock,
            metrics: a.metrics,
            tier_names: a.tier_names,
            tenant_tier: a.tenant_tier,
            live: HashMap::new(),
            next_id: 1,
            busy: false,
            wake_at: None,
            worker_ok: true,
            events: Vec::new(),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<SchedMsg>,
        msg: SchedMsg,
        st: &mut SchedState,
    ) -> Result<(), ActorProcessingErr> {
        let now = st.clock.now();
        match msg {
            SchedMsg::Submit { req, reply } => {
                let id = RequestId(st.next_id);
                st.next_id += 1;
                let tier = st
                    .tenant_tier
                    .get(req.tenant.0 as usize)
                    .copied()
                    .unwrap_or(0);
                let answer = if !st.worker_ok {
                    Err(Rejection::Unavailable)
                } else {
                    st.sched.submit(now, id, req).map(|()| {
                        let (tx, rx) = mpsc::unbounded_channel();
                        st.live.insert(id, Live { tx, tier });
                        let me = myself.clone();
                        RequestStream::new(
                            id,
                            rx,
                            Box::new(move || {
                                // After the end, or with the engine gone,
                                // there is nothing left to cancel.
                                let _ = me.cast(SchedMsg::Cancel(id));
                            }),
                        )
                    })
                };
                // The caller may have given up waiting; then the stream it
                // would have got is dropped here and cancels itself.
                let _ = reply.send(answer);
            }
            SchedMsg::Cancel(id) => {
                let live = st.live.remove(&id);
                if st.sched.cancel(now, id)
                    && let Some(l) = live
                {
                    st.metrics
                        .request_ended(&st.tier_names[l.tier], Terminal::Cancelled);
                }
            }
            SchedMsg::StepDone(r) => {
                let StepResult {
                    plan,
                    sampled,
                    elapsed,
                    worker_ok,
                } = *r;
                st.busy = false;
                st.worker_ok = worker_ok;
                st.metrics.step_time(elapsed.as_secs_f64());
                match sampled {
                    Ok(s) => st.sched.complete(now, &plan, &s),
                    Err(e) => {
                        tracing::error!(error = %e, "step failed");
                        st.sched.fail_step(now, &plan, &e);
                    }
                }
                record_load(st);
            }
            SchedMsg::Wake => {
                if st.wake_at.is_some_and(|w| w <= now) {
                    st.wake_at = None;
                }
            }
            SchedMsg::Status(reply) => {
                let mut s = st.sched.status();
                s.ready = st.worker_ok;
                let _ = reply.send(s);
            }
        }
        pump(&myself, st, now);
        Ok(())
    }
}

/// Delivers the state machine's events and, with the worker idle, starts
/// the next step.
fn pump(myself: &ActorRef<SchedMsg>, st: &mut SchedState, now: Duration) {
    if !st.busy && st.worker_ok {
        let plan = st.sched.schedule(now);
        if !plan.items.is_empty() {
            st.busy = true;
            if let Err(e) = st.worker.cast(WorkerMsg::Step {
                plan,
                reply: myself.clone(),
            }) {
                // The worker is gone: fail what was planned rather than
                // waiting for a reply that never comes.
                st.busy = false;
                st.worker_ok = false;
                if let ractor::MessagingErr::SendErr(WorkerMsg::Step { plan, .. }) = e {
                    st.sched.fail_step(now, &plan, "the GPU worker has stopped");
                }
            }
        }
    }
    deliver(st);
    if let Some(d) = st.sched.next_deadline()
        && st.wake_at.is_none_or(|w| d < w)
    {
        st.wake_at = Some(d);
        myself.send_after(d.saturating_sub(now), || SchedMsg::Wake);
    }
}

fn deliver(st: &mut SchedState) {
    // Reuse one buffer: the state machine's event queue is borrowed while
    // draining, and delivery needs the rest of the state.
    let mut events = std::mem::take(&mut st.events);
    events.extend(st.sched.drain_events());
    for ev in events.drain(..) {
        match ev {
            SchedEvent::Token { id, token } => {
                if let Some(l) = st.live.get(&id) {
                    let _ = l.tx.send(EngineEvent::Token(token));
                }
            }
            SchedEvent::Finished {
                id,
                reason,
                usage,
                timings,
            } => {
                let tier = tier_name(st, &timings);
                st.metrics.record_phases(&tier, &phases(&timings));
                st.metrics.tokens(
                    &tier,
                    usage.prompt_tokens as u64,
                    usage.completion_tokens as u64,
                    usage.cached_tokens as u64,
                );
                st.metrics.request_ended(&tier, Terminal::Finished);
                if let Some(l) = st.live.remove(&id) {
                    let _ = l.tx.send(EngineEvent::Finished { reason, usage });
                }
            }
            SchedEvent::Failed {
                id,
                failure,
                timings,
            } => {
                let tier = tier_name(st, &timings);
                let state = match failure {
                    EngineFailure::QueueTimeout { .. } => Terminal::TimedOut,
                    _ => Terminal::Error,
                };
                st.metrics.request_ended(&tier, state);
                if let Some(l) = st.live.remove(&id) {
                    let _ = l.tx.send(EngineEvent::Failed(failure));
                }
            }
            SchedEvent::Preempted { tier, .. } => {
                let name = st
                    .tier_names
                    .get(tier.0 as usize)
                    .map_or("unknown", |s| s.as_str());
                st.metrics.preempted(name);
            }
        }
    }
    st.events = events;
}

fn tier_name(st: &SchedState, t: &Timings) -> String {
    st.tier_names
        .get(t.tier.0 as usize)
        .cloned()
        .unwrap_or_else(|| "unknown".into())
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
    for t in &s.tiers {
        st.metrics
            .tier_load(&t.name, t.queued as u64, t.running as u64);
    }
}

/// The engine as the Router sees it: a handle to the Scheduler actor.
#[derive(Clone)]
pub struct LocalEngine {
    sched: ActorRef<SchedMsg>,
    worker: ActorRef<WorkerMsg>,
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

/// Starts the Scheduler and GpuWorker actors of one engine.
pub async fn spawn_engine(
    exec: Box<dyn Executor>,
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
    let sched = Scheduler::new(opts.sched).map_err(|e| EngineStartError::Config(e.to_string()))?;
    let (worker, _) = Actor::spawn(
        None,
        GpuWorker,
        WorkerArgs {
            exec,
            clock: clock.clone(),
        },
    )
    .await
    .map_err(|e| EngineStartError::Spawn(e.to_string()))?;
    let (sched, _) = Actor::spawn(
        None,
        SchedulerActor,
        SchedArgs {
            sched,
            worker: worker.clone(),
            clock,
            metrics,
            tier_names,
            tenant_tier,
        },
    )
    .await
    .map_err(|e| EngineStartError::Spawn(e.to_string()))?;
    Ok(LocalEngine { sched, worker })
}

impl LocalEngine {
    /// Stops both actors; queued and running requests see their streams end.
    pub fn stop(&self) {
        self.sched.stop(None);
        self.worker.stop(None);
    }
}

impl Engine for LocalEngine {
    fn submit(&self, req: EngineRequest) -> BoxFuture<Result<RequestStream, Rejection>> {
        let sched = self.sched.clone();
        Box::pin(async move {
            match sched
                .call(|reply| SchedMsg::Submit { req, reply }, None)
                .await
            {
                Ok(ractor::rpc::CallResult::Success(r)) => r,
                _ => Err(Rejection::Unavailable),
            }
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
