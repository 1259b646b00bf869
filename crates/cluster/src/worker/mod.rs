//! The engine node's side: requests that arrive over the transport are
//! submitted to the node's own engine (the same Scheduler, KvBlockPool and
//! GpuWorker actors `flotilla serve` runs), and their events go back to
//! the Router per step: the engine sends every event of one step for this
//! node's requests in one message to the node's sink
//! ([`Engine::submit_to`]), and it leaves as one frame per Router (split
//! only near the frame cap). No task and no channel per request.
//!
//! Every decision is [`NodeCore`]'s (a state machine in `flotilla-cores`); this
//! is the actor around it (ractor), which only moves messages: what the
//! transport delivers, the engine's step events and answers, and its own
//! timer go into the core with the time; the core's outputs go out to the
//! transport and the engine. It holds the engine's request handles, by
//! id, and drops one when the core says so.
//!
//! Every request is tied to the Router that sent it and that Router's
//! epoch. When the Router goes silent past the down-after bound, or comes
//! back with a new epoch, its requests are cancelled here, which gives
//! their KV blocks back: a dead Router never strands work on a worker.

// The shell owns the clock and spawns the engine calls that take time;
// the core (its own crate, `flotilla-cores`) does neither, and its build
// bans both. Each shell function that reads the clock or spawns says so
// (`allow` per function).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use flotilla_engine::{Engine, EventSink, KvMigration, RequestStream};
use flotilla_proto::wire::{KvTransferHeader, Message};
use flotilla_proto::{Rejection, RequestId, StepEvents};
use flotilla_transport::{Inbound, NodeId, Sink, Transport};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::sync::mpsc;
use tokio::time::Instant;

use flotilla_cores::node::{
    EngineAnswer, EngineCall, NodeCore, NodeInput, NodeOutput, NodeSettings, TransferSpan,
};
use flotilla_telemetry::{EventRec, SpanRec};

use crate::{CheckHook, Connect, Recorder};

/// How an engine node serves remote Routers: the core's settings (plain
/// data) and what only the shell holds.
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    /// The core's settings ([`crate::node_settings`] builds them from the
    /// config).
    pub settings: NodeSettings,
    /// Told of every orphan given back (the simulator's leak check).
    pub on_orphan: Option<OrphanHook>,
    /// Checks the core's bookkeeping after every input and is told the
    /// first thing that breaks (tests, the simulator).
    pub check: Option<CheckHook>,
    /// Set to `Some(grace)` to drain the node (SIGTERM in `flotilla node`,
    /// a fault in the simulator): it takes no new work, lets what runs
    /// finish within the grace, tells its Routers it is leaving, and
    /// [`run_worker`] returns [`WorkerEnd::Left`].
    pub drain: Option<tokio::sync::watch::Receiver<Option<Duration>>>,
    /// Exports the spans this node measures of traced requests (KV
    /// transfers); `None`: tracing is off.
    pub tracing: Option<flotilla_telemetry::Tracing>,
    /// Records every input the core handles, with its time and outputs
    /// (tests: a recorded run replays to the same outputs).
    pub record: Option<Recorder<NodeStep>>,
}

impl WorkerOptions {
    /// The shell around a core with `settings`, with no hooks.
    pub fn new(settings: NodeSettings) -> WorkerOptions {
        WorkerOptions {
            settings,
            on_orphan: None,
            check: None,
            drain: None,
            tracing: None,
            record: None,
        }
    }
}

/// Why [`run_worker`] returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerEnd {
    /// The transport closed (or the node actor failed).
    Closed,
    /// The node drained and told its Routers it is leaving.
    Left,
}

/// Called with a description of each orphaned lease a node gives back.
#[derive(Clone)]
pub struct OrphanHook(pub Arc<dyn Fn(&str) + Send + Sync>);

impl std::fmt::Debug for OrphanHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OrphanHook")
    }
}

/// Messages of the node actor.
enum NodeMsg {
    /// From the transport.
    Net(Inbound),
    /// One engine step's events.
    Step(StepEvents),
    /// An engine call that took time has its answer.
    Answer(EngineAnswer),
    /// An import finished: the request's handle, or why not.
    Imported {
        reservation: RequestId,
        result: Result<RequestStream, String>,
    },
    /// The core's deadline.
    Tick,
    /// Drain, with this grace.
    Drain(Duration),
}

struct NodeArgs {
    connect: Connect,
    engine: Arc<dyn Engine>,
    kv: Option<Arc<dyn KvMigration>>,
    opts: WorkerOptions,
    sink: EventSink,
    /// Set when the node has drained.
    left: Arc<AtomicBool>,
}

/// The node actor's state: the core, and where its outputs go.
struct NodeState {
    core: NodeCore,
    transport: Arc<dyn Transport>,
    engine: Arc<dyn Engine>,
    kv: Option<Arc<dyn KvMigration>>,
    /// Where the engine sends this node's requests' events.
    sink: EventSink,
    /// The engine's handles of this node's requests and prefills:
    /// dropping one ends it.
    streams: HashMap<RequestId, RequestStream>,
    on_orphan: Option<OrphanHook>,
    check: Option<CheckHook>,
    t0: Instant,
    /// The Tick already asked for, if any.
    tick_at: Option<Duration>,
    left: Arc<AtomicBool>,
    out: Vec<NodeOutput>,
    /// Records every input with its time and outputs (tests).
    record: Option<Recorder<NodeStep>>,
    /// The node's trace exporter, on this actor's clock.
    tracing: Option<flotilla_telemetry::Tracing>,
}

struct NodeActor;

impl Actor for NodeActor {
    type Msg = NodeMsg;
    type State = NodeState;
    type Arguments = NodeArgs;

    #[allow(
        clippy::disallowed_methods,
        reason = "the shell owns the clock and the tasks"
    )]
    async fn pre_start(
        &self,
        myself: ActorRef<NodeMsg>,
        a: NodeArgs,
    ) -> Result<NodeState, ActorProcessingErr> {
        let layout = a.kv.as_ref().map(|k| k.kv_layout());
        // The transport hands what arrives straight to this actor.
        let to = myself.clone();
        let sink = Sink::new(move |m| to.cast(NodeMsg::Net(m)).is_ok());
        let transport = (a.connect)(sink)?;
        let (me, epoch) = (transport.node(), transport.epoch());
        let t0 = Instant::now();
        let tracing = a
            .opts
            .tracing
            .as_ref()
            .map(|t| t.with_epoch(std::time::SystemTime::now()));
        let mut st = NodeState {
            tracing,
            on_orphan: a.opts.on_orphan.clone(),
            check: a.opts.check.clone(),
            record: a.opts.record.clone(),
            core: NodeCore::new(a.opts.settings, me, epoch, layout, Duration::ZERO),
            transport,
            engine: a.engine,
            kv: a.kv,
            sink: a.sink,
            streams: HashMap::new(),
            t0,
            tick_at: None,
            left: a.left,
            out: Vec::new(),
        };
        st.feed(&myself, NodeInput::Tick).await;
        Ok(st)
    }

    async fn handle(
        &self,
        myself: ActorRef<NodeMsg>,
        msg: NodeMsg,
        st: &mut NodeState,
    ) -> Result<(), ActorProcessingErr> {
        let input = match msg {
            // Where a node that joined at run time is (a Router's word,
            // ahead of a request that names it): the transport's business.
            NodeMsg::Net(Inbound::Message {
                msg: Message::Peer(peer),
                ..
            }) => {
                st.transport.learn(&peer);
                return Ok(());
            }
            // A node not in the config dialed this one (it will send P/D
            // or move traffic): the transport knows it now; the core needs
            // nothing more than its messages.
            NodeMsg::Net(Inbound::Joined(_)) => return Ok(()),
            NodeMsg::Net(Inbound::Message {
                from, epoch, msg, ..
            }) => NodeInput::Message { from, epoch, msg },
            NodeMsg::Net(Inbound::Bulk {
                from, header, data, ..
            }) => NodeInput::Bulk { from, header, data },
            NodeMsg::Net(Inbound::Closed) => {
                // This life's transport is gone (shut down, or the node
                // crashed in a simulation): every handle ends with the actor.
                myself.stop(Some("transport closed".into()));
                return Ok(());
            }
            NodeMsg::Net(Inbound::Undelivered { to, msg, reason }) => {
                crate::log_undelivered(to, &msg, &reason);
                NodeInput::Undelivered {
                    to,
                    msg,
                    reason: reason.to_string(),
                }
            }
            NodeMsg::Step(events) => NodeInput::Step(events),
            NodeMsg::Answer(a) => NodeInput::Answer(a),
            NodeMsg::Imported {
                reservation,
                result,
            } => {
                let result = result.map(|stream| {
                    let id = stream.id;
                    st.streams.insert(id, stream);
                    id
                });
                NodeInput::Answer(EngineAnswer::Imported {
                    reservation,
                    result,
                })
            }
            NodeMsg::Tick => {
                st.tick_at = None;
                NodeInput::Tick
            }
            NodeMsg::Drain(grace) => NodeInput::Drain { grace },
        };
        st.feed(&myself, input).await;
        if st.core.life_over() {
            // Its Leaving is queued on the transport; every handle it
            // holds ends with the actor.
            st.left.store(true, Ordering::Release);
            myself.stop(Some("left".into()));
        }
        Ok(())
    }
}

impl NodeState {
    #[allow(
        clippy::disallowed_methods,
        reason = "the shell owns the clock and the tasks"
    )]
    fn now(&self) -> Duration {
        Instant::now().saturating_duration_since(self.t0)
    }

    /// Runs one input through the core and carries out what it says. The
    /// engine calls answered at once are awaited here and their answers
    /// go in before anything else; calls that take time run as tasks that
    /// answer with a message.
    async fn feed(&mut self, myself: &ActorRef<NodeMsg>, input: NodeInput) {
        let mut answers: VecDeque<NodeInput> = VecDeque::new();
        let mut later: VecDeque<NodeInput> = VecDeque::new();
        let mut next = Some(input);
        while let Some(input) = next
            .take()
            .or_else(|| answers.pop_front())
            .or_else(|| later.pop_front())
        {
            let now = self.now();
            let recorded = self.record.as_ref().map(|_| input.clone());
            self.core.handle(now, input, &mut self.out);
            if let (Some(r), Some(input)) = (&self.record, recorded) {
                r.push(NodeStep {
                    now,
                    input,
                    outputs: self.out.clone(),
                });
            }
            let (core, transport) = (&self.core, &self.transport);
            CheckHook::run(
                &mut self.check,
                || format!("node {}", transport.node()),
                || core.check_invariants(),
            );
            let mut outs = std::mem::take(&mut self.out);
            for o in outs.drain(..) {
                match o {
                    NodeOutput::Send {
                        to,
                        correlation,
                        msg,
                    } => {
                        if let Err(e) = self.transport.send(to, correlation, msg) {
                            crate::log_undelivered(to, &e.msg, &e.reason);
                            later.push_back(NodeInput::Undelivered {
                                to,
                                reason: e.reason.to_string(),
                                msg: *e.msg,
                            });
                        }
                    }
                    NodeOutput::SendBulk {
                        id,
                        to,
                        header,
                        data,
                    } => self.send_bulk(myself, id, to, header, data),
                    NodeOutput::Reconnect(n) => self.transport.reconnect(n),
                    NodeOutput::Call(call) => {
                        if let Some(a) = self.call(myself, call).await {
                            answers.push_back(NodeInput::Answer(a));
                        }
                    }
                    NodeOutput::EndStream { id, stop_string } => {
                        if let Some(mut s) = self.streams.remove(&id) {
                            if stop_string {
                                s.ended_by_stop_string();
                            }
                            // Dropping the handle ends it in the engine.
                            drop(s);
                        }
                    }
                    NodeOutput::Orphan(what) => {
                        tracing::warn!("orphaned lease given back: {what}");
                        if let Some(h) = &self.on_orphan {
                            (h.0)(&what);
                        }
                    }
                    // The actor stops after this input (see `handle`).
                    NodeOutput::Left => tracing::info!("drained: leaving"),
                    NodeOutput::Span { parent, span } => {
                        if let Some(t) = &self.tracing {
                            t.export(&parent, transfer_span(span));
                        }
                    }
                }
            }
            // The buffer's capacity is kept for the next input.
            self.out = outs;
        }
        let now = self.now();
        let next = self.core.next_deadline();
        if self.tick_at.is_none_or(|t| next < t) {
            self.tick_at = Some(next);
            myself.send_after(next.saturating_sub(now), || NodeMsg::Tick);
        }
    }

    /// Makes an engine call: one answered at once returns its answer;
    /// one that takes time runs as a task that sends its answer to the
    /// actor.
    #[allow(
        clippy::disallowed_methods,
        reason = "the shell owns the clock and the tasks"
    )]
    async fn call(&mut self, myself: &ActorRef<NodeMsg>, call: EngineCall) -> Option<EngineAnswer> {
        // The core asks for KV calls only when it has a layout, which
        // comes from `kv`.
        let kv = self.kv.clone();
        let no_kv = || Rejection::Invalid("this node migrates no KV".into());
        match call {
            EngineCall::Submit { ticket, request } => {
                let result = match self.engine.submit_to(request, self.sink.clone()).await {
                    Ok(stream) => Ok(self.hold(stream)),
                    Err(r) => Err(r),
                };
                Some(EngineAnswer::Submitted { ticket, result })
            }
            EngineCall::Reserve {
                ticket,
                tenant,
                tokens,
                ttl,
            } => {
                let result = match &kv {
                    Some(kv) => kv.reserve_kv(tenant, tokens, ttl).await,
                    None => Err(no_kv()),
                };
                Some(EngineAnswer::Reserved { ticket, result })
            }
            EngineCall::SubmitForExport {
                ticket,
                request,
                hold,
            } => {
                let result = match &kv {
                    Some(kv) => match kv.submit_for_export(request, hold).await {
                        // A prefill's events come through the sink too.
                        Ok(stream) => Ok(self.hold(stream.forward_to(self.sink.clone()))),
                        Err(r) => Err(r),
                    },
                    None => Err(no_kv()),
                };
                Some(EngineAnswer::ExportSubmitted { ticket, result })
            }
            EngineCall::Detach { ticket, id, hold } => {
                let result = match &kv {
                    Some(kv) => kv.detach_kv(id, hold).await,
                    None => Err("this node migrates no KV".into()),
                };
                Some(EngineAnswer::Detached { ticket, result })
            }
            EngineCall::Status => Some(EngineAnswer::Status(self.engine.status().await)),
            EngineCall::PrefixChanges { snapshot } => Some(EngineAnswer::Prefix {
                snapshot,
                changes: match &kv {
                    Some(kv) => kv.prefix_changes(snapshot).await,
                    None => None,
                },
            }),
            EngineCall::KvHolders => {
                let holders = match &kv {
                    Some(kv) => kv.kv_holders().await,
                    None => Vec::new(),
                };
                Some(EngineAnswer::Holders(holders))
            }
            EngineCall::DropOrphan(id) => {
                let dropped = match &kv {
                    Some(kv) => kv.drop_orphan(id).await,
                    None => false,
                };
                Some(EngineAnswer::OrphanDropped { id, dropped })
            }
            EngineCall::Import {
                reservation,
                header,
                data,
                request,
            } => {
                let (to, sink) = (myself.clone(), self.sink.clone());
                tokio::spawn(async move {
                    let result = match kv {
                        Some(kv) => import(&*kv, reservation, header, data, request, sink).await,
                        None => Err("this node imports no KV".into()),
                    };
                    let _ = to.cast(NodeMsg::Imported {
                        reservation,
                        result,
                    });
                });
                None
            }
            EngineCall::Export(id) => {
                let to = myself.clone();
                tokio::spawn(async move {
                    let result = match kv {
                        Some(kv) => kv.export_kv(id).await,
                        None => Err("this node exports no KV".into()),
                    };
                    let _ = to.cast(NodeMsg::Answer(EngineAnswer::Exported { id, result }));
                });
                None
            }
            EngineCall::CancelReservation(id) => {
                if let Some(kv) = kv {
                    tokio::spawn(async move { kv.cancel_reservation(id).await });
                }
                None
            }
            EngineCall::Release(id) => {
                if let Some(kv) = kv {
                    tokio::spawn(async move {
                        let released = kv.release_kv(id).await;
                        tracing::debug!(%id, released, "prefill blocks given back");
                    });
                }
                None
            }
        }
    }

    /// Keeps a request's handle; its id for the core.
    fn hold(&mut self, stream: RequestStream) -> RequestId {
        let id = stream.id;
        self.streams.insert(id, stream);
        id
    }

    #[allow(
        clippy::disallowed_methods,
        reason = "the shell owns the clock and the tasks"
    )]
    fn send_bulk(
        &self,
        myself: &ActorRef<NodeMsg>,
        id: RequestId,
        to: NodeId,
        header: KvTransferHeader,
        data: Bytes,
    ) {
        let (transport, me) = (self.transport.clone(), myself.clone());
        tokio::spawn(async move {
            let (bytes, req, t0) = (data.len(), header.req, Instant::now());
            let r = transport.send_bulk(to, header, data).await;
            let us = t0.elapsed().as_micros().max(1);
            tracing::debug!(
                req,
                bytes,
                us,
                "KV sent to node {to}: {:.3} GB/s",
                bytes as f64 / us as f64 / 1e3
            );
            let result = r.map_err(|e| e.to_string());
            let _ = me.cast(NodeMsg::Answer(EngineAnswer::BulkSent { id, result }));
        });
    }
}

/// Serves remote Routers (and, on prefill and decode nodes, each other)
/// until its transport closes or the node has drained (`opts.drain`):
/// starts the node actor, whose transport (made by `connect`) delivers to
/// its mailbox, and moves the engine's step events to it. `kv` is the
/// engine's migration side; without it the node serves whole requests
/// only. When it returns the actor has stopped and every request it held
/// is ended. An error: the actor could not start (its transport could not
/// be made, say), with why.
#[allow(
    clippy::disallowed_methods,
    reason = "the shell owns the clock and the tasks"
)]
pub async fn run_worker(
    connect: Connect,
    engine: Arc<dyn Engine>,
    kv: Option<Arc<dyn KvMigration>>,
    mut opts: WorkerOptions,
) -> Result<WorkerEnd, String> {
    // Every request's events come through one sink, a message per engine
    // step, and leave as one frame per Router.
    let (sink, mut sink_rx) = mpsc::unbounded_channel::<StepEvents>();
    let drain = opts.drain.take();
    let left = Arc::new(AtomicBool::new(false));
    let args = NodeArgs {
        connect,
        engine,
        kv,
        opts,
        sink,
        left: left.clone(),
    };
    let (actor, done) = Actor::spawn(None, NodeActor, args)
        .await
        .map_err(|e| format!("starting the node actor: {e}"))?;
    let to = actor.clone();
    let steps = tokio::spawn(async move {
        while let Some(s) = sink_rx.recv().await {
            if to.cast(NodeMsg::Step(s)).is_err() {
                return;
            }
        }
    });
    let drains = drain.map(|mut rx| {
        let to = actor.clone();
        tokio::spawn(async move {
            loop {
                if let Some(grace) = *rx.borrow_and_update()
                    && to.cast(NodeMsg::Drain(grace)).is_err()
                {
                    return;
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        })
    });
    let _ = done.await;
    steps.abort();
    if let Some(d) = drains {
        d.abort();
    }
    Ok(if left.load(Ordering::Acquire) {
        WorkerEnd::Left
    } else {
        WorkerEnd::Closed
    })
}

/// Writes a transfer (checked by the core) into its reservation and
/// continues the request from the prefill node's first token.
async fn import(
    kv: &dyn KvMigration,
    reservation: RequestId,
    h: KvTransferHeader,
    data: Vec<Bytes>,
    req: flotilla_proto::EngineRequest,
    sink: flotilla_engine::EventSink,
) -> Result<RequestStream, String> {
    let mut bytes = Vec::with_capacity(h.bytes as usize);
    for c in &data {
        bytes.extend_from_slice(c);
    }
    drop(data);
    kv.import_kv(reservation, h.token_count, bytes, req, h.first, Some(sink))
        .await
        .map_err(|r| format!("decode node refused the KV: {r}"))
}

/// A KV transfer's times, as the core measured them, as a span.
fn transfer_span(t: TransferSpan) -> SpanRec {
    let mut s = SpanRec::new("kv.transfer", t.start, t.end)
        .attr("flotilla.kv.decode_node", i64::from(t.decode))
        .attr("flotilla.kv.bytes", t.bytes as i64)
        .attr("flotilla.kv.blocks", i64::from(t.blocks))
        .attr("flotilla.kv.tokens", i64::from(t.tokens))
        .attr("flotilla.kv.acked", t.acked)
        .attr(
            "flotilla.kv.purpose",
            if t.moving { "move" } else { "prefill" },
        );
    for (name, at) in [("export", t.export), ("send", t.send), ("sent", t.sent)] {
        if let Some(at) = at {
            s.events.push(EventRec {
                name: name.into(),
                at,
                attrs: Vec::new(),
            });
        }
    }
    s.error = t.failure;
    s
}

/// One input a node's core handled, with its time and what it did.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeStep {
    /// The core's time.
    pub now: Duration,
    /// The input.
    pub input: NodeInput,
    /// Its outputs, in order.
    pub outputs: Vec<NodeOutput>,
}
