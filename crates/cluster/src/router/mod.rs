//! The Router across nodes: [`ClusterEngine`], an [`Engine`] whose
//! requests run on engine nodes over the transport. The HTTP front
//! (`flotilla-gateway`) drives it exactly as it drives an engine in its own
//! process; it cannot tell the difference.
//!
//! Every decision is [`RouterCore`]'s (a state machine in `flotilla-cores`); this
//! is the actor around it (ractor), which only moves messages: the
//! transport's inbound messages, clients' submits and drops, and its own
//! timer go into the core with the time; the core's outputs go out to the
//! transport and to the clients' streams. A message the transport refuses
//! goes back into the core, which places the request elsewhere.

// The actor owns the clock and spawns the task that feeds it; the core
// (its own crate, `flotilla-cores`) does neither, and its build bans both.
// Each shell function that reads the clock or spawns says so (`allow` per
// function).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use flotilla_engine::{BoxFuture, Engine, RequestStream, StreamChunk};
use flotilla_proto::{
    DrainRefusal, EngineEvent, EngineRequest, EngineStatus, Rejection, RequestId,
};
use flotilla_transport::{Inbound, Sink, Transport};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use rustc_hash::FxHashMap;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use flotilla_cores::router::{Reach, RouterCore, RouterInput, RouterOptions, RouterOutput};

use crate::Recorder;

/// Messages of the Router actor.
enum RouterMsg {
    /// A client's request; the answer comes on `admitted`, the events on
    /// `events`.
    Submit {
        /// The client's id.
        id: u64,
        /// The request.
        req: EngineRequest,
        /// Where its events go.
        events: mpsc::UnboundedSender<StreamChunk>,
        /// Where the admission answer goes.
        admitted: oneshot::Sender<Result<(), Rejection>>,
    },
    /// The client dropped its stream.
    ClientGone {
        /// The client's id.
        id: u64,
        /// It ended at a stop string.
        stop_string: bool,
    },
    /// A message from the transport.
    Net(Inbound),
    /// The core's deadline.
    Tick,
    /// Figures for `/ready`.
    Status(RpcReplyPort<EngineStatus>),
    /// Names of the nodes up.
    UpNodes(RpcReplyPort<Vec<String>>),
    /// An operator's drain of an engine node.
    Drain {
        node: String,
        grace: Duration,
        reply: RpcReplyPort<Result<(), DrainRefusal>>,
    },
}

struct Client {
    events: mpsc::UnboundedSender<StreamChunk>,
    admitted: Option<oneshot::Sender<Result<(), Rejection>>>,
}

/// Told what broke when a checked Router's bookkeeping goes wrong
/// ([`ClusterEngine::start_with`]).
#[derive(Clone)]
pub struct CheckHook(pub Arc<dyn Fn(&str) + Send + Sync>);

impl CheckHook {
    /// Runs `check` if `slot` holds a hook, and tells it the first thing
    /// that broke (named `what`); the hook is dropped then: the state is
    /// suspect from there on.
    pub(crate) fn run(
        slot: &mut Option<CheckHook>,
        what: impl FnOnce() -> String,
        check: impl FnOnce() -> Result<(), String>,
    ) {
        if let Some(hook) = slot
            && let Err(broken) = check()
        {
            (hook.0)(&format!("{} invariant broken: {broken}", what()));
            *slot = None;
        }
    }
}

impl std::fmt::Debug for CheckHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CheckHook")
    }
}

/// The Router actor's state: the core and where its outputs go.
struct RouterState {
    core: RouterCore,
    /// Check the core's invariants after every input (tests, simulator).
    check: Option<CheckHook>,
    transport: Arc<dyn Transport>,
    t0: Instant,
    clients: FxHashMap<u64, Client>,
    /// The Tick already asked for, if any.
    tick_at: Option<Duration>,
    out: Vec<RouterOutput>,
    /// Records every input with its time, reach and outputs (tests).
    record: Option<Recorder<RouterStep>>,
}

/// One input the Router's core handled, with its time, what the transport
/// could reach, and what it did: a recorded run replays to the same
/// outputs ([`RouterCore`] is a function of these).
#[derive(Clone, Debug, PartialEq)]
pub struct RouterStep {
    /// The core's time.
    pub now: Duration,
    /// The nodes out of reach.
    pub reach: Reach,
    /// The input.
    pub input: RouterInput,
    /// Its outputs, in order.
    pub outputs: Vec<RouterOutput>,
}

/// What the Router's shell carries besides the core's settings.
#[derive(Clone, Debug, Default)]
pub struct RouterHooks {
    /// Checks the core's invariants after every input and is told the
    /// first that breaks (tests, the simulator).
    pub check: Option<CheckHook>,
    /// Records every input (tests).
    pub record: Option<Recorder<RouterStep>>,
}

struct RouterActor;

struct RouterArgs {
    connect: Connect,
    opts: RouterOptions,
    hooks: RouterHooks,
}

/// Makes a node's transport, given the sink its arrivals go to (the
/// node's actor mailbox): called once, as the actor starts.
pub type Connect = Box<dyn FnOnce(Sink) -> Result<Arc<dyn Transport>, String> + Send>;

impl Actor for RouterActor {
    type Msg = RouterMsg;
    type State = RouterState;
    type Arguments = RouterArgs;

    #[allow(
        clippy::disallowed_methods,
        reason = "the shell owns the clock and the tasks"
    )]
    async fn pre_start(
        &self,
        myself: ActorRef<RouterMsg>,
        a: RouterArgs,
    ) -> Result<RouterState, ActorProcessingErr> {
        // The transport hands what arrives straight to this actor.
        let me = myself.clone();
        let sink = Sink::new(move |m| me.cast(RouterMsg::Net(m)).is_ok());
        let transport = (a.connect)(sink)?;
        let mut st = RouterState {
            core: RouterCore::new(a.opts, Duration::ZERO),
            check: a.hooks.check,
            record: a.hooks.record,
            transport,
            t0: Instant::now(),
            clients: FxHashMap::default(),
            tick_at: None,
            out: Vec::new(),
        };
        st.feed(&myself, RouterInput::Tick);
        Ok(st)
    }

    async fn handle(
        &self,
        myself: ActorRef<RouterMsg>,
        msg: RouterMsg,
        st: &mut RouterState,
    ) -> Result<(), ActorProcessingErr> {
        let input = match msg {
            RouterMsg::Submit {
                id,
                req,
                events,
                admitted,
            } => {
                st.clients.insert(
                    id,
                    Client {
                        events,
                        admitted: Some(admitted),
                    },
                );
                RouterInput::Submit { id, req }
            }
            RouterMsg::ClientGone { id, stop_string } => {
                st.clients.remove(&id);
                RouterInput::ClientGone { id, stop_string }
            }
            RouterMsg::Net(Inbound::Message {
                from, epoch, msg, ..
            }) => RouterInput::Message { from, epoch, msg },
            // The Router takes no bulk transfers; its life is its handle's.
            RouterMsg::Net(Inbound::Bulk { .. } | Inbound::Closed) => return Ok(()),
            RouterMsg::Net(Inbound::Joined(peer)) => RouterInput::Joined(peer),
            RouterMsg::Net(Inbound::Undelivered { to, msg, reason }) => {
                crate::log_undelivered(to, &msg, &reason);
                RouterInput::Undelivered { to, msg }
            }
            RouterMsg::Tick => {
                st.tick_at = None;
                RouterInput::Tick
            }
            RouterMsg::Status(reply) => {
                let transport = &st.transport;
                let reach = Reach::except(st.core.nodes().filter(|&n| !transport.is_reachable(n)));
                let _ = reply.send(st.core.status_reaching(&reach));
                return Ok(());
            }
            RouterMsg::UpNodes(reply) => {
                let _ = reply.send(st.core.up_nodes());
                return Ok(());
            }
            RouterMsg::Drain { node, grace, reply } => {
                let checked = st.core.drain_target(&node).map(|_| ());
                let ok = checked.is_ok();
                let _ = reply.send(checked);
                if !ok {
                    return Ok(());
                }
                RouterInput::Drain { node, grace }
            }
        };
        st.feed(&myself, input);
        Ok(())
    }
}

impl RouterState {
    #[allow(
        clippy::disallowed_methods,
        reason = "the shell owns the clock and the tasks"
    )]
    fn now(&self) -> Duration {
        Instant::now().saturating_duration_since(self.t0)
    }

    /// Runs one input through the core and carries out what it says,
    /// feeding back what the transport refused and clients that are gone.
    fn feed(&mut self, myself: &ActorRef<RouterMsg>, input: RouterInput) {
        let now = self.now();
        let mut next = Some(input);
        // What the outputs send back (refused sends, clients gone): rare.
        let mut later: VecDeque<RouterInput> = VecDeque::new();
        while let Some(input) = next.take().or_else(|| later.pop_front()) {
            // What the transport can reach is an input too, taken now.
            let transport = &self.transport;
            let reach = Reach::except(self.core.nodes().filter(|&n| !transport.is_reachable(n)));
            let recorded = self.record.as_ref().map(|_| (input.clone(), reach.clone()));
            self.core.handle(now, input, &reach, &mut self.out);
            if let (Some(r), Some((input, reach))) = (&self.record, recorded) {
                r.push(RouterStep {
                    now,
                    reach,
                    input,
                    outputs: self.out.clone(),
                });
            }
            let core = &self.core;
            CheckHook::run(
                &mut self.check,
                || "router".into(),
                || core.check_invariants(),
            );
            let mut outs = std::mem::take(&mut self.out);
            for o in outs.drain(..) {
                match o {
                    RouterOutput::Send {
                        to,
                        correlation,
                        msg,
                    } => {
                        if let Err(e) = self.transport.send(to, correlation, msg) {
                            crate::log_undelivered(to, &e.msg, &e.reason);
                            later.push_back(RouterInput::Undelivered { to, msg: *e.msg });
                        }
                    }
                    RouterOutput::Reconnect(n) => self.transport.reconnect(n),
                    RouterOutput::Forget(n) => self.transport.forget(n),
                    RouterOutput::Admitted { id, result } => {
                        let refused = result.is_err();
                        let answered = self
                            .clients
                            .get_mut(&id)
                            .and_then(|c| c.admitted.take())
                            .is_some_and(|a| a.send(result).is_ok());
                        if refused {
                            self.clients.remove(&id);
                        } else if !answered {
                            // The client stopped waiting.
                            self.clients.remove(&id);
                            later.push_back(RouterInput::ClientGone {
                                id,
                                stop_string: false,
                            });
                        }
                    }
                    RouterOutput::Events { id, events } => {
                        let ended = events
                            .last()
                            .is_some_and(|e| !matches!(e, EngineEvent::Token(_)));
                        if let Some(c) = self.clients.get(&id) {
                            let _ = c.events.send(events.into());
                        }
                        if ended {
                            self.clients.remove(&id);
                        }
                    }
                }
            }
            // The buffer's capacity is kept for the next input.
            self.out = outs;
        }
        let next = self.core.next_deadline();
        if self.tick_at.is_none_or(|t| next < t) {
            self.tick_at = Some(next);
            myself.send_after(next.saturating_sub(now), || RouterMsg::Tick);
        }
    }
}

/// Stops the Router actor when the last handle goes.
struct Handle(ActorRef<RouterMsg>);

impl Drop for Handle {
    fn drop(&mut self) {
        self.0.stop(None);
    }
}

/// The Router's engine: requests go to engine nodes over the transport.
#[derive(Clone)]
pub struct ClusterEngine {
    actor: Arc<Handle>,
    next_id: Arc<AtomicU64>,
}

impl ClusterEngine {
    /// Starts the Router actor on the current tokio runtime; `connect`
    /// makes its transport, which delivers to the actor's mailbox.
    pub async fn start(connect: Connect, opts: RouterOptions) -> Result<ClusterEngine, String> {
        Self::start_with(connect, opts, RouterHooks::default()).await
    }

    /// [`ClusterEngine::start`] with the shell's hooks: the core's
    /// invariants checked after every input, every input recorded.
    #[allow(
        clippy::disallowed_methods,
        reason = "the shell owns the clock and the tasks"
    )]
    pub async fn start_with(
        connect: Connect,
        opts: RouterOptions,
        hooks: RouterHooks,
    ) -> Result<ClusterEngine, String> {
        let args = RouterArgs {
            connect,
            opts,
            hooks,
        };
        let (actor, _) = Actor::spawn(None, RouterActor, args)
            .await
            .map_err(|e| format!("starting the Router actor: {e}"))?;
        Ok(ClusterEngine {
            actor: Arc::new(Handle(actor)),
            next_id: Arc::new(AtomicU64::new(1)),
        })
    }

    /// Names of the nodes currently up.
    pub async fn up_nodes(&self) -> Vec<String> {
        match self.actor.0.call(RouterMsg::UpNodes, None).await {
            Ok(ractor::rpc::CallResult::Success(n)) => n,
            _ => Vec::new(),
        }
    }
}

impl Engine for ClusterEngine {
    fn submit(&self, req: EngineRequest) -> BoxFuture<Result<RequestStream, Rejection>> {
        let actor = self.actor.0.clone();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        Box::pin(async move {
            let (events, rx) = mpsc::unbounded_channel();
            let (admitted, answer) = oneshot::channel();
            let submit = RouterMsg::Submit {
                id,
                req,
                events,
                admitted,
            };
            if actor.cast(submit).is_err() {
                return Err(Rejection::Unavailable);
            }
            // The core answers within one round trip, or at its admission
            // deadline; a stopped Router drops the sender.
            match answer.await {
                Ok(Ok(())) => {}
                Ok(Err(r)) => return Err(r),
                Err(_) => return Err(Rejection::Unavailable),
            }
            let on_drop = Box::new(move |stop_string: bool| {
                let _ = actor.cast(RouterMsg::ClientGone { id, stop_string });
            });
            Ok(RequestStream::batched(RequestId(id), rx, on_drop))
        })
    }

    fn status(&self) -> BoxFuture<EngineStatus> {
        let actor = self.actor.0.clone();
        Box::pin(async move {
            match actor.call(RouterMsg::Status, None).await {
                Ok(ractor::rpc::CallResult::Success(s)) => s,
                _ => EngineStatus::default(),
            }
        })
    }

    fn drain_node(&self, node: &str, grace: Duration) -> BoxFuture<Result<(), DrainRefusal>> {
        let actor = self.actor.0.clone();
        let node = node.to_owned();
        Box::pin(async move {
            let name = node.clone();
            let ask = |reply| RouterMsg::Drain { node, grace, reply };
            match actor.call(ask, None).await {
                Ok(ractor::rpc::CallResult::Success(r)) => r,
                // The Router has stopped: no node can be reached.
                _ => Err(DrainRefusal::NotUp(name)),
            }
        })
    }
}
