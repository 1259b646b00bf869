//! `RouterCore`: the Router's decisions as a state machine. Inputs (a
//! client's request, a client gone, a message from a node, a message the
//! transport could not take, time passing) go in with `now`; outputs
//! (messages to send, admissions and events for clients, a reconnect) come
//! out. It does no I/O, reads no clock and spawns nothing, so a test
//! drives it with a plain clock and a list of messages; the actor around it
//! (`flotilla_cluster::ClusterEngine`) only moves messages.
//!
//! - Membership: every engine node sends a heartbeat with its status each
//!   interval. A node silent for `down_after` is marked down: no new work
//!   goes to it, and its in-flight requests are re-run elsewhere when no
//!   token has reached the client yet, or end with a clear error. A node
//!   heard with a new epoch restarted: the same happens to the old life's
//!   requests, and it takes work again at once.
//! - Routing: the cost of a worker is the prompt blocks it would have to
//!   compute (blocks it is believed to hold already are free, see
//!   [`crate::prefix`]) plus the KV blocks of the requests it is running
//!   now, so a cached prefix wins unless its worker is much busier.
//! - Disaggregated prefill and decode: with `decode` and `prefill` nodes in
//!   the config, a request goes to a decode node (fewest KV blocks in
//!   flight, enough free blocks) together with the name of a prefill node
//!   (fewest prompt blocks to compute, as above). The decode node reserves
//!   the blocks, the prefill node computes the prompt and its first token
//!   and sends the KV over; events come from the decode node. If the
//!   prefill node is lost, or the transfer fails, before any token reached
//!   the client, the request is run again (colocated on a decode node
//!   after a failed transfer).
//! - Event order: each batch names its index in the stream; duplicates are
//!   dropped, early batches held until the gap fills, and a gap that
//!   outlasts the down bound ends the request.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use flotilla_proto::wire::{Held, JoinedPeer, Message, ReqEvents, Submit};
use flotilla_proto::{
    DrainRefusal, EngineEvent, EngineFailure, EngineRequest, EngineStatus, KvDtype, KvUsage,
    NodeId, NodeStatus, PrefixChanges, Rejection, Role, RoutingStats, TierStatus,
};
use rustc_hash::FxHashMap;

use crate::prefix::{PrefixIndex, block_hashes};

/// How the Router routes and watches its engine nodes.
#[derive(Clone, Debug)]
pub struct RouterOptions {
    /// Engine nodes: (node id, name, role).
    pub workers: Vec<(NodeId, String, Role)>,
    /// Heartbeat period (the Router sends its own at this rate too).
    pub heartbeat_interval: Duration,
    /// A node silent this long is down.
    pub down_after: Duration,
    /// Tokens per KV block on the workers.
    pub block_size: usize,
    /// Prefix-cache salt per tenant (0 = shared), as the workers salt it.
    pub tenant_salts: Vec<u64>,
    /// Times a request that produced no token yet is re-run after its node failed.
    pub reruns_max: u32,
    /// Times a request that streamed tokens is moved to another node when
    /// its node is lost (it resumes from the tokens the client has).
    pub moves_max: u32,
    /// Blocks remembered per worker by the prefix index.
    pub prefix_blocks_max: usize,
    /// A node that joined at run time (is not in `workers`) and has been
    /// down this long, with nothing of it left in flight, is forgotten.
    pub forget_after: Duration,
}

/// How long a joined node is remembered after it went down, unless the
/// config says otherwise.
pub const FORGET_AFTER: Duration = Duration::from_secs(60);

/// Times a request that produced no token yet is re-run after its node failed.
pub const RERUNS_MAX: u32 = 2;

/// Times a streaming request moves to another node when its node is lost.
pub const MOVES_MAX: u32 = 3;

/// Blocks the Router's prefix index remembers per node.
pub const PREFIX_BLOCKS_MAX: usize = 1 << 20;

/// The engine nodes the transport has no way to now (their link is down
/// and redials): an input of every [`RouterCore::handle`], taken by the
/// shell just before it, so that the inputs alone describe a run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reach {
    /// Sorted, without repeats.
    unreachable: Vec<NodeId>,
}

impl Reach {
    /// Every node reachable.
    pub fn all() -> Reach {
        Reach::default()
    }

    /// Every node but `nodes`.
    pub fn except(nodes: impl IntoIterator<Item = NodeId>) -> Reach {
        let mut unreachable: Vec<NodeId> = nodes.into_iter().collect();
        unreachable.sort_unstable();
        unreachable.dedup();
        Reach { unreachable }
    }

    /// Whether a message sent to `node` now has a way there.
    pub fn reaches(&self, node: NodeId) -> bool {
        self.unreachable.binary_search(&node).is_err()
    }

    /// The nodes out of reach, in order.
    pub fn unreachable(&self) -> &[NodeId] {
        &self.unreachable
    }
}

/// What happens to the Router.
#[derive(Clone, Debug, PartialEq)]
pub enum RouterInput {
    /// A client's request, under an id the caller chose (unique).
    Submit {
        /// The client's id.
        id: u64,
        /// The validated, tokenized request.
        req: EngineRequest,
    },
    /// The client no longer wants request `id` (disconnect, stop string,
    /// gave up waiting for admission).
    ClientGone {
        /// The client's id.
        id: u64,
        /// The Router ended it at a stop string: the node finishes it.
        stop_string: bool,
    },
    /// A message from an engine node.
    Message {
        /// Sender.
        from: NodeId,
        /// Sender's epoch.
        epoch: u64,
        /// The message.
        msg: Message,
    },
    /// A message the transport refused to queue (the peer is gone).
    Undelivered {
        /// Where it was going.
        to: NodeId,
        /// The message.
        msg: Message,
    },
    /// Time passed: heartbeats, silent nodes, event gaps and admission
    /// deadlines that are due.
    Tick,
    /// A node that is not in the config connected (the transport checked
    /// its certificate): it is placed on once its first heartbeat comes.
    Joined(JoinedPeer),
    /// An operator asks engine node `node` to drain (checked first with
    /// [`RouterCore::drain_target`]; ignored if it no longer holds).
    Drain {
        /// The node's name.
        node: String,
        /// How long what runs there may take to finish.
        grace: Duration,
    },
}

/// What the Router does.
#[derive(Clone, Debug, PartialEq)]
pub enum RouterOutput {
    /// Send a message to a node.
    Send {
        /// The node.
        to: NodeId,
        /// Correlation id of the envelope (request id, 0 when none).
        correlation: u64,
        /// The message.
        msg: Message,
    },
    /// The node restarted: our connection reaches its old life; dial again.
    Reconnect(NodeId),
    /// A joined node is forgotten: drop the link to it.
    Forget(NodeId),
    /// The answer to a client's `Submit`: queued on a node, or refused.
    /// Comes once per request, before any of its events.
    Admitted {
        /// The client's id.
        id: u64,
        /// Queued, or why not.
        result: Result<(), Rejection>,
    },
    /// Events for a client, in order: tokens, then possibly the one
    /// terminal event (after which the client's id is forgotten).
    Events {
        /// The client's id.
        id: u64,
        /// The events.
        events: Vec<EngineEvent>,
    },
}

struct WorkerView {
    node: NodeId,
    name: String,
    role: Role,
    /// Prefills sent to this (prefill) node whose first token has not come.
    prefilling: u32,
    epoch: u64,
    heard: Option<Duration>,
    up: bool,
    load: EngineStatus,
    in_flight: u32,
    in_flight_blocks: u64,
    routed: u64,
    downs: u64,
    moved_away: u64,
    moved_by_kv: u64,
    /// P/D reservations it refused for lack of blocks.
    kv_short: u64,
    /// The life (epoch) that said it is leaving: its later messages are
    /// a drained node's last words, not a sign of life.
    left_epoch: u64,
    prefix: PrefixIndex,
    /// The number of the last `Prefix` applied from its current life, if
    /// the index follows its reports (it had the whole since).
    prefix_seq: Option<u64>,
    /// When the whole was last asked for (a gap): asked again only after
    /// a heartbeat interval.
    resync_asked: Option<Duration>,
    /// Placements (request, attempt) taken away from this node while it
    /// was silent, stopped again when it is heard from: the Cancel sent
    /// then may not have reached it, and a Submit held on the cut link may
    /// reach it only after the link heals, when the request runs elsewhere.
    recall: Vec<(u64, u32)>,
    /// A node that joined at run time: where it was seen, and since when
    /// it is known (it is forgotten after a silence).
    joined: Option<(String, Duration)>,
    /// A joined node forgotten: this slot is free for the next one.
    gone: bool,
}

impl WorkerView {
    /// A node known, not heard yet; `joined`: where a node that joined at
    /// run time was seen, and when.
    fn new(
        node: NodeId,
        name: String,
        role: Role,
        prefix_blocks_max: usize,
        joined: Option<(String, Duration)>,
    ) -> WorkerView {
        WorkerView {
            node,
            name,
            role,
            prefilling: 0,
            epoch: 0,
            heard: None,
            up: false,
            load: EngineStatus::default(),
            in_flight: 0,
            in_flight_blocks: 0,
            routed: 0,
            downs: 0,
            moved_away: 0,
            moved_by_kv: 0,
            kv_short: 0,
            left_epoch: 0,
            prefix: PrefixIndex::new(prefix_blocks_max),
            prefix_seq: None,
            resync_asked: None,
            recall: Vec::new(),
            joined,
            gone: false,
        }
    }
}

struct Pending {
    worker: usize,
    epoch: u64,
    /// The prefill node computing its prompt, until its first token comes.
    prefill: Option<usize>,
    /// The prefill node paired with this placement (kept after the first
    /// token): told to drop its held KV if the decode node is lost.
    paired_prefill: Option<usize>,
    /// Run it whole on one node (a KV transfer for it failed).
    colocate: bool,
    /// This placement continues it with the KV of the node it ran on
    /// (`paired_prefill`), until its first new token comes.
    kv_move: bool,
    /// Whether the client has had its admission answer.
    admitted: bool,
    /// When a client still waiting for admission is refused.
    admit_by: Duration,
    /// Tokens of the current placement the client has had (its events'
    /// indices count from 0).
    tokens_sent: u32,
    /// Those tokens: a move continues from them.
    streamed: Vec<u32>,
    /// Tokens the client had from earlier placements (moves): `req` is
    /// the original prompt followed by them, with that many fewer
    /// `max_tokens`.
    base: u32,
    /// The original prompt's length (for the usage the client sees).
    prompt_len: u32,
    /// Times it moved.
    moves: u32,
    /// Event batches that came ahead of a missing one, by first index.
    early: BTreeMap<u32, ReqEvents>,
    /// Since when a batch has been missing.
    gap_since: Option<Duration>,
    blocks: u64,
    reruns: u32,
    /// Submits of this request the transport refused (a node it could
    /// not reach): past two, it is refused rather than tried again.
    undelivered: u32,
    req: EngineRequest,
}

/// What a request that lost its placement may do when no other node takes
/// it as it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fallback {
    /// Nothing: it waits for a node, or fails.
    Nothing,
    /// Continue from the KV of this node, which left in order (tried
    /// before any other placement, for a request that moves).
    KvOf(usize),
    /// Run whole on any node, the excluded one included (it queues it).
    Whole,
}

/// Event batches one request may hold while one before them is missing.
const EARLY_MAX: usize = 256;

/// How long past its last node's down bound a client may wait for its
/// admission answer: a node that dies first is noticed by silence and the
/// request re-run or refused, so this is a last resort.
const ADMIT_GRACE: Duration = Duration::from_secs(5);

/// The Router's state machine.
pub struct RouterCore {
    opts: RouterOptions,
    workers: Vec<WorkerView>,
    /// Index into `workers` by node id (every message looks its sender up).
    by_node: BTreeMap<NodeId, usize>,
    /// By request id: hashed (a lookup per batch of events), with a
    /// fixed hash, so the same inputs give the same order.
    pending: FxHashMap<u64, Pending>,
    /// (deadline, id) of every request whose client waits for its
    /// admission answer: the next deadline without a pass over `pending`.
    admit_by: BTreeSet<(Duration, u64)>,
    /// Silence and gaps are checked four times per heartbeat interval, so
    /// a node is marked down at most a quarter interval after its bound.
    next_check: Duration,
    /// Checks until the Router's own heartbeat goes out again.
    checks_to_heartbeat: u32,
    /// Requests that lost their node when no other could take them: each
    /// waits (until then) for one that can, by id.
    parked: BTreeMap<u64, (Duration, Pending, String)>,
    /// Placements and how the prefix index served them.
    routing: RoutingStats,
    /// The time of the input being handled.
    now: Duration,
    out: Vec<RouterOutput>,
}

impl RouterCore {
    /// A Router that knows `opts.workers`, none heard yet, at time `now`.
    pub fn new(opts: RouterOptions, now: Duration) -> RouterCore {
        let workers: Vec<WorkerView> = opts
            .workers
            .iter()
            .map(|(node, name, role)| {
                WorkerView::new(*node, name.clone(), *role, opts.prefix_blocks_max, None)
            })
            .collect();
        RouterCore {
            by_node: workers
                .iter()
                .enumerate()
                .map(|(i, w)| (w.node, i))
                .collect(),
            workers,
            pending: FxHashMap::default(),
            admit_by: BTreeSet::new(),
            next_check: now,
            checks_to_heartbeat: 0,
            parked: BTreeMap::new(),
            routing: RoutingStats::default(),
            now,
            out: Vec::new(),
            opts,
        }
    }

    /// The engine nodes it routes to: those whose reachability the shell
    /// reports in each input's [`Reach`].
    pub fn nodes(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.workers.iter().filter(|w| !w.gone).map(|w| w.node)
    }

    /// Handles one input at `now`; `reach` says which nodes the transport
    /// has no way to now (their link redials), as the shell saw it just
    /// before this input. The outputs
    /// are appended to `out`, in the order they must be carried out.
    pub fn handle(
        &mut self,
        now: Duration,
        input: RouterInput,
        reach: &Reach,
        out: &mut Vec<RouterOutput>,
    ) {
        debug_assert!(self.out.is_empty());
        self.now = now;
        match input {
            RouterInput::Submit { id, req } => self.submit(now, id, req, reach),
            RouterInput::ClientGone { id, stop_string } => self.abandon(id, stop_string),
            RouterInput::Message { from, epoch, msg } => {
                self.on_message(now, from, epoch, msg, reach)
            }
            RouterInput::Undelivered { to, msg } => self.undelivered(to, msg, reach),
            RouterInput::Tick => self.tick(now, reach),
            RouterInput::Joined(peer) => self.joined(now, peer),
            RouterInput::Drain { node, grace } => {
                if let Ok(w) = self.drain_target(&node) {
                    let grace_ms = grace.as_millis().min(u128::from(u64::MAX)) as u64;
                    tracing::info!(node = %node, grace_ms, "asked to drain");
                    self.send(self.workers[w].node, 0, Message::Drain { grace_ms });
                }
            }
        }
        out.append(&mut self.out);
    }

    /// The engine node named `name`, if a drain can be asked of it now.
    pub fn drain_target(&self, name: &str) -> Result<usize, DrainRefusal> {
        let Some(w) = self.workers.iter().position(|w| w.name == name && !w.gone) else {
            return Err(DrainRefusal::UnknownNode {
                name: name.to_owned(),
                nodes: self
                    .workers
                    .iter()
                    .filter(|w| !w.gone)
                    .map(|w| w.name.clone())
                    .collect(),
            });
        };
        if !self.workers[w].up {
            return Err(DrainRefusal::NotUp(name.to_owned()));
        }
        Ok(w)
    }

    /// When the next [`RouterInput::Tick`] is due.
    pub fn next_deadline(&self) -> Duration {
        // What waits for a node is looked at with every silence check.
        self.admit_by
            .first()
            .map_or(self.next_check, |&(d, _)| d.min(self.next_check))
    }

    /// Names of the nodes up now.
    pub fn up_nodes(&self) -> Vec<String> {
        self.workers
            .iter()
            .filter(|w| w.up)
            .map(|w| w.name.clone())
            .collect()
    }

    /// Requests in flight (admitted or waiting for their answer).
    pub fn in_flight(&self) -> usize {
        self.pending.len() + self.parked.len()
    }

    /// The cluster as `/ready` shows it: the sum of the nodes that are up,
    /// and every node's line.
    pub fn status(&self) -> EngineStatus {
        self.status_reaching(&Reach::all())
    }

    /// [`RouterCore::status`], ready only through a node that `reach`
    /// reaches (a node's heartbeats can arrive before this side's link to
    /// it is up again: it cannot take a request until then).
    pub fn status_reaching(&self, reach: &Reach) -> EngineStatus {
        let mut s = EngineStatus::default();
        let mut tiers: Vec<TierStatus> = Vec::new();
        for w in self.workers.iter().filter(|w| !w.gone) {
            s.nodes.push(NodeStatus {
                name: w.name.clone(),
                up: w.up,
                epoch: w.epoch,
                in_flight: w.in_flight,
                routed: w.routed,
                downs: w.downs,
                moved_away: w.moved_away,
                moved_by_kv: w.moved_by_kv,
                kv_short: w.kv_short,
                kv_orphans: w.load.orphans,
                kv_dtype: w.load.kv.dtype,
                kv_blocks: w.load.kv.total,
            });
            s.orphans += w.load.orphans;
            if !w.up {
                continue;
            }
            let l = &w.load;
            s.ready |= l.ready && reach.reaches(w.node);
            s.steps += l.steps;
            s.running += l.running;
            s.preemptions += l.preemptions;
            s.kv = KvUsage {
                total: s.kv.total + l.kv.total,
                free: s.kv.free + l.kv.free,
                used: s.kv.used + l.kv.used,
                cached: s.kv.cached + l.kv.cached,
                held: s.kv.held + l.kv.held,
                reserved: s.kv.reserved + l.kv.reserved,
                // Nodes of one cluster should agree; each node's line says its own.
                dtype: l.kv.dtype,
                offload: s.kv.offload.plus(&l.kv.offload),
            };
            for t in &l.tiers {
                match tiers.iter_mut().find(|x| x.name == t.name) {
                    Some(x) => {
                        x.queued += t.queued;
                        x.running += t.running;
                    }
                    None => tiers.push(t.clone()),
                }
            }
        }
        s.tiers = tiers;
        s.routing = self.routing;
        s
    }

    /// The bookkeeping agrees with the requests: every client waiting for
    /// admission has its deadline armed, and every node's in-flight count,
    /// KV blocks and prefills in progress are those of the requests placed
    /// on it. Err names the first that disagrees.
    pub fn check_invariants(&self) -> Result<(), String> {
        let waiting: BTreeSet<(Duration, u64)> = self
            .pending
            .iter()
            .filter(|(_, p)| !p.admitted)
            .map(|(&id, p)| (p.admit_by, id))
            .collect();
        if let Some(id) = self.parked.keys().find(|id| self.pending.contains_key(id)) {
            return Err(format!(
                "request {id} is placed and waits for a node at once"
            ));
        }
        if waiting != self.admit_by {
            return Err(format!(
                "{} requests wait for admission, {} admission deadlines are armed",
                waiting.len(),
                self.admit_by.len()
            ));
        }
        for (i, w) in self.workers.iter().enumerate() {
            let mine = self.pending.values().filter(|p| p.worker == i);
            let (n, blocks) = mine.fold((0u32, 0u64), |(n, b), p| (n + 1, b + p.blocks));
            let prefilling = self
                .pending
                .values()
                .filter(|p| p.prefill == Some(i))
                .count() as u32;
            if (n, blocks, prefilling) != (w.in_flight, w.in_flight_blocks, w.prefilling) {
                return Err(format!(
                    "node {}: books {} requests, {} blocks, {} prefills; its requests are {n}, \
                     {blocks} blocks, {prefilling} prefills",
                    w.name, w.in_flight, w.in_flight_blocks, w.prefilling
                ));
            }
        }
        Ok(())
    }

    fn send(&mut self, to: NodeId, correlation: u64, msg: Message) {
        self.out.push(RouterOutput::Send {
            to,
            correlation,
            msg,
        });
    }

    fn submit(&mut self, now: Duration, id: u64, req: EngineRequest, reach: &Reach) {
        let hashes = self.hashes(&req);
        let blocks = (req.prompt.len() as u64 + req.max_tokens as u64)
            .div_ceil(self.opts.block_size.max(1) as u64);
        let admit_by = now + self.node_wait();
        self.admit_by.insert((admit_by, id));
        let old = self.pending.insert(
            id,
            Pending {
                worker: 0,
                epoch: 0,
                prefill: None,
                paired_prefill: None,
                colocate: false,
                kv_move: false,
                admitted: false,
                admit_by,
                tokens_sent: 0,
                streamed: Vec::new(),
                base: 0,
                prompt_len: req.prompt.len() as u32,
                moves: 0,
                early: BTreeMap::new(),
                gap_since: None,
                blocks,
                reruns: 0,
                undelivered: 0,
                req,
            },
        );
        assert!(old.is_none(), "request id {id} submitted twice");
        if !hashes.is_empty() {
            // Did any node that could take it hold a prefix of it?
            let candidate = self
                .workers
                .iter()
                .enumerate()
                .any(|(i, w)| Self::usable(w, i, None, reach) && w.prefix.matched(&hashes) > 0);
            self.routing.placements += 1;
            self.routing.cache_candidate += u64::from(candidate);
            self.routing.prompt_blocks += hashes.len() as u64;
        }
        if !self.route(id, &hashes, None, reach) {
            self.unplace(id);
            // Said here: the client's 503 is all that tells of it otherwise.
            tracing::info!(
                "request {id} refused (unavailable): no node up and reachable can take it ({} up of {})",
                self.workers.iter().filter(|w| w.up).count(),
                self.workers.len()
            );
            self.out.push(RouterOutput::Admitted {
                id,
                result: Err(Rejection::Unavailable),
            });
        }
    }

    /// Whether node `i` can take work now.
    fn usable(w: &WorkerView, i: usize, exclude: Option<usize>, reach: &Reach) -> bool {
        w.up && w.load.ready && !w.load.draining && Some(i) != exclude && reach.reaches(w.node)
    }

    /// The cheapest up node for a request, skipping `exclude`, and the
    /// prefill node to pair it with when it is a decode node. KV moves only
    /// between nodes whose blocks have one element type: a decode node is
    /// paired only with a prefill node of its KV dtype (with none, it
    /// computes the prompt itself), and `kv_like` (a move that continues
    /// from another node's KV) keeps to nodes of that dtype.
    fn pick(
        &self,
        hashes: &[u64],
        need_blocks: u64,
        exclude: Option<usize>,
        colocate: bool,
        kv_like: Option<KvDtype>,
        reach: &Reach,
    ) -> Option<(usize, Option<usize>)> {
        // The best prefill node of each KV dtype.
        let prefill_for = |dtype: KvDtype| -> Option<usize> {
            if colocate {
                return None;
            }
            self.workers
                .iter()
                .enumerate()
                .filter(|(i, w)| {
                    w.role == Role::Prefill
                        && w.load.kv.dtype == dtype
                        && Self::usable(w, *i, exclude, reach)
                })
                .min_by_key(|(_, w)| {
                    let compute = (hashes.len() - w.prefix.matched(hashes)) as u64;
                    (compute + w.in_flight_blocks, w.prefilling, w.routed)
                })
                .map(|(i, _)| i)
        };
        let prefill: [Option<usize>; 3] = KvDtype::ALL.map(prefill_for);
        let prefill_of = |w: &WorkerView| {
            let d = KvDtype::ALL.iter().position(|&d| d == w.load.kv.dtype);
            d.and_then(|d| prefill[d])
                .filter(|_| w.role == Role::Decode)
        };
        self.workers
            .iter()
            .enumerate()
            .filter(|(i, w)| {
                w.role != Role::Prefill
                    && kv_like.is_none_or(|d| w.load.kv.dtype == d)
                    && Self::usable(w, *i, exclude, reach)
            })
            .min_by_key(|(_, w)| {
                // A worker whose whole cache is too small comes last; if it
                // is the only one, its engine gives the client the reason.
                let too_small = w.load.kv.total != 0 && need_blocks > u64::from(w.load.kv.total);
                // A decode node paired with a prefill node computes no
                // prompt, but needs the blocks free now.
                let paired = prefill_of(w).is_some();
                let short = paired && need_blocks > u64::from(w.load.kv.free);
                let compute = if paired {
                    0
                } else {
                    (hashes.len() - w.prefix.matched(hashes)) as u64
                };
                (
                    too_small,
                    short,
                    compute + w.in_flight_blocks,
                    w.in_flight,
                    w.routed,
                )
            })
            .map(|(i, w)| (i, prefill_of(w)))
    }

    /// Picks a node (and prefill node) for pending request `id` and sends
    /// it there.
    fn route(&mut self, id: u64, hashes: &[u64], exclude: Option<usize>, reach: &Reach) -> bool {
        let (need, colocate) = {
            let p = &self.pending[&id];
            (p.blocks, p.colocate)
        };
        let Some((w, prefill)) = self.pick(hashes, need, exclude, colocate, None, reach) else {
            return false;
        };
        self.dispatch(w, prefill, id, hashes, false);
        true
    }

    /// Moves pending request `id` (its prompt holds every token its client
    /// has) to another node that continues it with the KV of node `from`,
    /// which it leaves. False if no node can take it.
    fn route_with_kv(&mut self, id: u64, hashes: &[u64], from: usize, reach: &Reach) -> bool {
        let need = self.pending[&id].blocks;
        let dtype = self.workers[from].load.kv.dtype;
        let Some((w, _)) = self.pick(hashes, need, Some(from), true, Some(dtype), reach) else {
            return false;
        };
        self.dispatch(w, Some(from), id, hashes, true);
        true
    }

    /// Sends request `id` to worker `w`, naming `prefill` as the node that
    /// computes its prompt (with `kv_move`: the node whose KV it continues
    /// from), and books it.
    fn dispatch(
        &mut self,
        w: usize,
        prefill: Option<usize>,
        id: u64,
        hashes: &[u64],
        kv_move: bool,
    ) {
        let p = self
            .pending
            .get(&id)
            .expect("dispatch of an unknown request");
        if p.reruns == 0 && p.moves == 0 && !kv_move {
            // The first placement: the blocks the chosen node (or its
            // prefill node) was known to hold.
            let by = prefill.unwrap_or(w);
            self.routing.matched_blocks += self.workers[by].prefix.matched(hashes) as u64;
        }
        let submit = Submit {
            req: id,
            attempt: p.reruns,
            prefill: prefill.map(|i| self.workers[i].node),
            kv_move,
            request: p.req.clone(),
        };
        let blocks = p.blocks;
        let node = self.workers[w].node;
        // The node it takes the KV from joined at run time: tell this one
        // where it is first (it knows only the config's nodes).
        if let Some(i) = prefill
            && let Some(peer) = self.joined_peer(i)
        {
            self.send(node, 0, Message::Peer(peer));
        }
        // What the node checks when it lands (its tenant, its placement
        // newer than any it holds): placed only on a node up and taking
        // work, and never back on the node it is moving off with its KV.
        debug_assert!(
            self.workers[w].up && !self.workers[w].load.draining,
            "request {id} placed on node {node}, which is down or draining"
        );
        debug_assert!(
            !kv_move || prefill != Some(w),
            "request {id} moved with its KV onto the node it leaves"
        );
        self.send(node, id, Message::Submit(submit));
        let view = &mut self.workers[w];
        view.in_flight += 1;
        view.in_flight_blocks += blocks;
        view.routed += 1;
        let epoch = view.epoch;
        match prefill {
            // The node it leaves computes nothing for it.
            Some(_) if kv_move => self.workers[w].prefix.insert(hashes),
            Some(pi) => {
                let pv = &mut self.workers[pi];
                pv.prefilling += 1;
                pv.routed += 1;
                pv.prefix.insert(hashes);
            }
            None => self.workers[w].prefix.insert(hashes),
        }
        let p = self.pending.get_mut(&id).expect("checked above");
        p.worker = w;
        p.epoch = epoch;
        p.prefill = prefill.filter(|_| !kv_move);
        p.paired_prefill = prefill;
        p.kv_move = kv_move;
        // Held batches of an earlier run are not this run's.
        p.early.clear();
        p.gap_since = None;
    }

    /// The first token of `id` came (or it ended): its prefill node is done.
    fn prefill_done(&mut self, id: u64) {
        if let Some(p) = self.pending.get_mut(&id)
            && let Some(pi) = p.prefill.take()
        {
            let pv = &mut self.workers[pi];
            pv.prefilling = pv.prefilling.saturating_sub(1);
        }
    }

    /// Puts back a request taken out by [`Self::finish`] to be placed
    /// again (its admission deadline too, while its client waits).
    fn replace(&mut self, id: u64, p: Pending) {
        if !p.admitted {
            self.admit_by.insert((p.admit_by, id));
        }
        self.pending.insert(id, p);
    }

    /// Takes out a request that no node took (nothing booked for it).
    fn unplace(&mut self, id: u64) -> Pending {
        let p = self.pending.remove(&id).expect("a pending request");
        if !p.admitted {
            self.admit_by.remove(&(p.admit_by, id));
        }
        p
    }

    /// The client of `id` gets its admission answer: queued.
    fn admit(&mut self, id: u64) {
        let p = self
            .pending
            .get_mut(&id)
            .expect("admit of an unknown request");
        p.admitted = true;
        self.admit_by.remove(&(p.admit_by, id));
        self.out.push(RouterOutput::Admitted { id, result: Ok(()) });
    }

    /// Removes a request and gives back its share of its worker's load.
    fn finish(&mut self, id: u64) -> Option<Pending> {
        self.prefill_done(id);
        let p = self.pending.remove(&id)?;
        if !p.admitted {
            self.admit_by.remove(&(p.admit_by, id));
        }
        let w = &mut self.workers[p.worker];
        w.in_flight = w.in_flight.saturating_sub(1);
        w.in_flight_blocks = w.in_flight_blocks.saturating_sub(p.blocks);
        if p.kv_move
            && let Some(from) = p.paired_prefill
        {
            // Its move with its KV ends before it took: the node it left
            // may still run it (it stops it when asked for the KV).
            let cancel = Message::Cancel {
                req: id,
                stop_string: false,
                attempt: p.reruns,
            };
            self.send(self.workers[from].node, id, cancel);
        }
        Some(p)
    }

    /// Stops the current placement of a request on its node.
    fn cancel_on_node(&mut self, p: &Pending, id: u64, stop_string: bool) {
        let cancel = Message::Cancel {
            req: id,
            stop_string,
            attempt: p.reruns,
        };
        self.send(self.workers[p.worker].node, id, cancel);
    }

    /// The client no longer wants request `id`: forget it and tell its
    /// worker, if it still runs.
    fn abandon(&mut self, id: u64, stop_string: bool) {
        if let Some(p) = self.finish(id) {
            self.cancel_on_node(&p, id, stop_string);
        }
        // Or it waited for a node: nothing runs anywhere.
        self.parked.remove(&id);
    }

    /// Ends a request that failed: a refusal if the client is still
    /// waiting for admission, else a failure event on its stream.
    fn fail(&mut self, id: u64, p: Pending, r: Rejection, f: EngineFailure) {
        // Said once here: the client's error is all that tells of it
        // otherwise.
        if p.admitted {
            tracing::info!("request {id} failed: {f}");
        } else {
            tracing::info!("request {id} refused ({r}): {f}");
        }
        self.out.push(if p.admitted {
            RouterOutput::Events {
                id,
                events: vec![EngineEvent::Failed(f)],
            }
        } else {
            RouterOutput::Admitted { id, result: Err(r) }
        });
    }

    /// The transport would not take a message. A `Submit` of the current
    /// placement goes to another node; anything else is left to the
    /// silence and reconcile paths (as a message lost with its peer).
    fn undelivered(&mut self, to: NodeId, msg: Message, reach: &Reach) {
        let Message::Submit(s) = msg else { return };
        let Some(&w) = self.by_node.get(&to) else {
            return;
        };
        let current = self
            .pending
            .get(&s.req)
            .is_some_and(|p| p.worker == w && p.reruns == s.attempt && p.tokens_sent == 0);
        if !current {
            return;
        }
        let why = format!("{} cannot be reached", self.workers[w].name);
        let Some(mut p) = self.finish(s.req) else {
            return;
        };
        p.undelivered += 1;
        if p.undelivered <= 2 {
            let hashes = self.hashes(&p.req);
            self.replace(s.req, p);
            if self.route(s.req, &hashes, Some(w), reach) {
                return;
            }
            p = self.unplace(s.req);
        }
        self.fail(
            s.req,
            p,
            Rejection::Unavailable,
            EngineFailure::Internal(format!("worker {why}; no other worker could take it")),
        );
    }

    /// Worker `w` is gone (silent, or restarted with a new epoch): re-run
    /// what produced nothing yet, fail the rest. Requests whose prompt it
    /// was computing for a decode node are cancelled there and re-run.
    /// With `kv`, the node left in order (drained) and still serves its
    /// KV for a while: what ran there moves with it.
    fn worker_lost(&mut self, w: usize, why: &str, (kv, silent): (bool, bool), reach: &Reach) {
        let mut ids: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| {
                (p.worker == w && p.epoch <= self.workers[w].epoch)
                    || (p.prefill == Some(w) && p.tokens_sent == 0)
            })
            .map(|(id, _)| *id)
            .collect();
        // In request order, as a sorted map would give them.
        ids.sort_unstable();
        let v = &mut self.workers[w];
        v.prefix.clear();
        // Its next life numbers its reports from 1, starting with the
        // whole cache.
        v.prefix_seq = None;
        v.resync_asked = None;
        let name = self.workers[w].name.clone();
        for id in ids {
            let p = &self.pending[&id];
            let (worker, epoch, reruns) = (p.worker, p.epoch, p.reruns);
            if worker == w
                && let Some(pf) = p.paired_prefill.filter(|&pf| pf != w)
            {
                // The lost decode node will never ack or cancel the KV its
                // prefill node holds for it: without this the blocks stay
                // leased there until the hold deadline.
                let abandon = Message::PrefillAbandon {
                    decode: self.workers[w].node,
                    decode_epoch: epoch,
                    req: id,
                };
                self.send(self.workers[pf].node, id, abandon);
            }
            let fallback = if kv && worker == w {
                Fallback::KvOf(w)
            } else {
                Fallback::Nothing
            };
            self.rerun_or_fail(id, Some(w), &format!("{name} {why}"), fallback, reach);
            let kv_moved = self
                .pending
                .get(&id)
                .is_some_and(|p| p.kv_move && p.paired_prefill == Some(w));
            if !kv_moved {
                // Stop it where it was placed: a decode node that is fine
                // frees its reservation, and a node that only seems lost
                // (our direction of the link still works) frees its blocks
                // now instead of at its own deadline. (One it moves from
                // with its KV stops it when asked for the KV.)
                let cancel = Message::Cancel {
                    req: id,
                    stop_string: false,
                    attempt: reruns,
                };
                self.send(self.workers[worker].node, id, cancel);
                if silent && worker == w {
                    self.workers[w].recall.push((id, reruns));
                }
            }
        }
    }

    /// Runs `id` again elsewhere if no token reached its client yet (and
    /// it has re-runs left), else ends it with `why`; `fallback` says
    /// what else it may do.
    fn rerun_or_fail(
        &mut self,
        id: u64,
        exclude: Option<usize>,
        why: &str,
        fallback: Fallback,
        reach: &Reach,
    ) {
        let Some(mut p) = self.finish(id) else {
            return;
        };
        let lost = p.worker;
        let movable =
            p.tokens_sent > 0 && p.moves < self.opts.moves_max && p.req.max_tokens > p.tokens_sent;
        if movable {
            // The client has tokens: the next node continues from them,
            // with the prompt and every token sent so far (sampling is a
            // function of seed and position, so it continues as it would
            // have). Its events count from 0 again.
            let sent = std::mem::take(&mut p.streamed);
            p.req.prompt.extend_from_slice(&sent);
            p.req.generated += sent.len() as u32;
            p.req.max_tokens -= p.tokens_sent;
            p.base += p.tokens_sent;
            p.tokens_sent = 0;
            p.moves += 1;
            // Its blocks stay as booked: the prompt grew by what
            // `max_tokens` lost.
        }
        if p.tokens_sent == 0 && p.reruns < self.opts.reruns_max + p.moves {
            p.reruns += 1;
            // Batches held for a gap were the last placement's: the next
            // one's indices start again at 0.
            p.early.clear();
            p.gap_since = None;
            let hashes = self.hashes(&p.req);
            self.replace(id, p);
            let routed = match fallback {
                Fallback::KvOf(from) if movable => {
                    self.route_with_kv(id, &hashes, from, reach)
                        || self.route(id, &hashes, exclude, reach)
                }
                Fallback::Whole => {
                    self.route(id, &hashes, exclude, reach) || {
                        self.pending.get_mut(&id).expect("replaced").colocate = true;
                        self.route(id, &hashes, None, reach)
                    }
                }
                _ => self.route(id, &hashes, exclude, reach),
            };
            if routed {
                if movable {
                    self.workers[lost].moved_away += 1;
                }
                let p = &self.pending[&id];
                let to = &self.workers[p.worker].name;
                if movable {
                    let n = p.base;
                    let with = if p.kv_move { " with its KV" } else { "" };
                    tracing::info!("request {id}: {why}; moved to {to}{with} after {n} tokens");
                } else {
                    tracing::info!("request {id}: {why}; re-running it on {to}");
                }
                return;
            }
            p = self.unplace(id);
            // No node can take it now: it waits a while for one (a node
            // cut off may come back, a restarted one rejoins) rather than
            // the client losing the answer at once.
            let until = self.now + self.node_wait();
            tracing::info!("request {id}: {why}; no node can take it now, it waits for one");
            self.parked.insert(id, (until, p, why.to_owned()));
            return;
        }
        self.fail_unplaced(id, p, why);
    }

    /// Ends a request that lost its node and found no other.
    fn fail_unplaced(&mut self, id: u64, p: Pending, why: &str) {
        let sent = p.base + p.tokens_sent;
        let msg = if p.moves >= self.opts.moves_max && p.tokens_sent > 0 {
            format!(
                "worker {why} after {sent} tokens of this request were sent; it had \
                 moved {} times already, the most allowed",
                p.moves
            )
        } else {
            format!(
                "worker {why} after {sent} tokens of this request were sent; no other \
                 worker could take it over"
            )
        };
        self.fail(id, p, Rejection::Unavailable, EngineFailure::Internal(msg));
    }

    /// Places what waits for a node where one can take it now; ends what
    /// waited too long.
    fn unpark(&mut self, now: Duration, reach: &Reach) {
        let ids: Vec<u64> = self.parked.keys().copied().collect();
        for id in ids {
            let (until, p, why) = self.parked.remove(&id).expect("listed above");
            let hashes = self.hashes(&p.req);
            self.replace(id, p);
            if self.route(id, &hashes, None, reach) {
                let to = &self.workers[self.pending[&id].worker].name;
                tracing::info!("request {id}: placed on {to} after waiting for a node");
                continue;
            }
            let p = self.unplace(id);
            if now >= until {
                let waited = self.node_wait().as_millis();
                let why = format!("{why}, and none could within {waited} ms");
                self.fail_unplaced(id, p, &why);
            } else {
                self.parked.insert(id, (until, p, why));
            }
        }
    }

    /// How long a request may wait for a node to take it: a client for
    /// its admission answer, or a stream that lost its node.
    fn node_wait(&self) -> Duration {
        self.opts.down_after * 3 + ADMIT_GRACE
    }

    fn hashes(&self, req: &EngineRequest) -> Vec<u64> {
        let salt = self
            .opts
            .tenant_salts
            .get(req.tenant.0 as usize)
            .copied()
            .unwrap_or(0);
        block_hashes(&req.prompt, self.opts.block_size, salt)
    }

    /// A node's prefix-cache report: the whole replaces what the index
    /// had; changes apply when they follow the last one applied; a gap
    /// (a report lost with a connection) asks for the whole again.
    fn on_prefix(&mut self, now: Duration, w: usize, seq: u64, changes: PrefixChanges) {
        let interval = self.opts.heartbeat_interval;
        let v = &mut self.workers[w];
        if changes.full {
            v.prefix.clear();
            v.prefix.insert(&changes.stored);
            v.prefix_seq = Some(seq);
            v.resync_asked = None;
            self.routing.prefix_snapshots += 1;
            return;
        }
        if v.prefix_seq.is_some_and(|last| seq == last + 1) {
            v.prefix.remove(&changes.removed);
            v.prefix.insert(&changes.stored);
            v.prefix_seq = Some(seq);
            return;
        }
        if v.prefix_seq.is_some_and(|last| seq <= last) {
            // A duplicate: applied already.
            return;
        }
        v.prefix_seq = None;
        if v.resync_asked.is_none_or(|at| now >= at + interval) {
            v.resync_asked = Some(now);
            tracing::debug!(node = %v.name, seq, "a gap in the prefix reports: asking for the whole");
            let node = v.node;
            self.send(node, 0, Message::PrefixResync);
        }
    }

    fn on_message(&mut self, now: Duration, from: NodeId, epoch: u64, msg: Message, reach: &Reach) {
        let Some(&w) = self.by_node.get(&from) else {
            return;
        };
        if epoch <= self.workers[w].left_epoch {
            return;
        }
        if epoch > self.workers[w].epoch {
            if self.workers[w].epoch != 0 {
                // Our link still reaches its old life: frames sent there
                // would vanish until the idle timeout.
                self.out.push(RouterOutput::Reconnect(from));
                // Its old life's requests are gone with it.
                self.workers[w].recall.clear();
                self.worker_lost(w, "restarted", (false, false), reach);
                tracing::info!(node = %self.workers[w].name, "rejoined with a new epoch");
            }
            self.workers[w].epoch = epoch;
        }
        let view = &mut self.workers[w];
        view.heard = Some(now);
        if !view.up {
            tracing::info!(node = %view.name, "up");
        }
        view.up = true;
        if !view.recall.is_empty() {
            let (node, recall) = (view.node, std::mem::take(&mut view.recall));
            for (req, attempt) in recall {
                let cancel = Message::Cancel {
                    req,
                    stop_string: false,
                    attempt,
                };
                self.send(node, req, cancel);
            }
        }
        match msg {
            Message::Heartbeat(load) => {
                if load.draining && !self.workers[w].load.draining {
                    tracing::info!(node = %self.workers[w].name, "draining: no new work goes there");
                }
                self.workers[w].load = load;
            }
            Message::Prefix { seq, changes } => self.on_prefix(now, w, seq, changes),
            Message::Leaving => {
                let v = &mut self.workers[w];
                v.left_epoch = epoch;
                v.up = false;
                tracing::info!(node = %v.name, "left (drained)");
                self.worker_lost(w, "left (drained)", (true, false), reach);
            }
            Message::Holding { held } => {
                // What it still holds that we no longer run there (we ended
                // or moved it while it was cut off), or prefill KV kept for
                // a decode node that no longer has the request.
                let known = |h: &Held| {
                    self.pending
                        .get(&h.req)
                        .is_some_and(|p| match h.for_decode {
                            None => p.worker == w && p.reruns == h.attempt,
                            Some(d) => {
                                p.paired_prefill == Some(w) && self.workers[p.worker].node == d
                            }
                        })
                };
                let unknown: Vec<Held> = held.into_iter().filter(|h| !known(h)).collect();
                if !unknown.is_empty() {
                    self.send(from, 0, Message::Unknown { held: unknown });
                }
            }
            Message::Admitted { req }
                if self
                    .pending
                    .get(&req)
                    .is_some_and(|p| p.worker == w && !p.admitted) =>
            {
                self.admit(req);
            }
            Message::Refused { req, rejection } => {
                if self.pending.get(&req).is_none_or(|p| p.worker != w) {
                    return;
                }
                // A decode node without blocks to reserve: another node
                // (or a colocated run) may have them.
                let full = matches!(
                    rejection,
                    Rejection::QueueFull { .. } | Rejection::Unavailable
                );
                // A node that takes no work now (draining, stopping): any
                // other node may.
                let closed = rejection == Rejection::Unavailable;
                let paired = self.pending[&req].prefill.is_some();
                // Not draining: it had no blocks free to reserve.
                if closed && paired && !self.workers[w].load.draining {
                    self.workers[w].kv_short += 1;
                }
                if (full && paired) || closed {
                    // A decode node that had no blocks to reserve now: if
                    // no other can pair, it runs the request whole, queued
                    // in its engine until blocks free up (its queue limits
                    // still answer), rather than a 503 while it has room.
                    let fallback = if paired && !self.workers[w].load.draining {
                        Fallback::Whole
                    } else {
                        Fallback::Nothing
                    };
                    let why = format!("{} refused it ({rejection})", self.workers[w].name);
                    self.rerun_or_fail(req, Some(w), &why, fallback, reach);
                } else if let Some(p) = self.finish(req) {
                    let f = EngineFailure::Internal(format!("re-run refused: {rejection}"));
                    self.fail(req, p, rejection, f);
                }
            }
            Message::Events(batch) => {
                for ev in batch {
                    self.on_events(now, w, from, ev, reach);
                }
            }
            _ => {}
        }
    }

    /// One request's batch from node `w`: applied in stream order.
    fn on_events(&mut self, now: Duration, w: usize, from: NodeId, ev: ReqEvents, reach: &Reach) {
        let ours = self
            .pending
            .get_mut(&ev.req)
            .filter(|p| p.worker == w && p.reruns == ev.attempt);
        let Some(p) = ours else {
            // Work this Router no longer wants (it was failed or moved
            // while the node was unreachable): stop it.
            if ev.end().is_none() {
                let cancel = Message::Cancel {
                    req: ev.req,
                    stop_string: false,
                    // That placement (a later one there may be the current one).
                    attempt: ev.attempt,
                };
                self.send(from, ev.req, cancel);
            }
            return;
        };
        let req = ev.req;
        if ev.first > p.tokens_sent {
            // A batch before it is missing (reordered, or lost): hold this
            // one until the gap fills.
            if p.early.len() >= EARLY_MAX {
                self.lost_in_transit(req);
                return;
            }
            p.gap_since.get_or_insert(now);
            p.early.insert(ev.first, ev);
            return;
        }
        let mut next = Some(ev);
        while let Some(ev) = next.take() {
            self.apply_events(w, ev, reach);
            let Some(p) = self.pending.get_mut(&req) else {
                break;
            };
            match p.early.first_key_value() {
                Some((&k, _)) if k <= p.tokens_sent => {
                    next = p.early.pop_first().map(|(_, e)| e);
                }
                Some(_) => {}
                None => p.gap_since = None,
            }
        }
    }

    /// Delivers one in-order batch (`first <= tokens_sent`): the tokens
    /// the client has not had yet, then the end, if any.
    fn apply_events(&mut self, w: usize, ev: ReqEvents, reach: &Reach) {
        let id = ev.req;
        let Some(p) = self.pending.get_mut(&id) else {
            return;
        };
        // A duplicate's tokens the client already has.
        let skip = (p.tokens_sent - ev.first) as usize;
        match ev.end() {
            Some(EngineEvent::Failed(EngineFailure::KvTransfer(why))) if p.tokens_sent == 0 => {
                // Nothing reached the client: run it again, whole on one
                // node this time.
                p.colocate = true;
                let why = format!("{}: KV transfer failed: {why}", self.workers[w].name);
                self.rerun_or_fail(id, None, &why, Fallback::Nothing, reach);
                return;
            }
            Some(EngineEvent::Failed(EngineFailure::RouterLost(why)))
                if ev.token_count() <= skip =>
            {
                // The node stopped hearing us (our direction of the link
                // was cut) and dropped it: the client's tokens so far are
                // all it will get from there.
                let why = format!("{} dropped it: {why}", self.workers[w].name);
                self.rerun_or_fail(id, Some(w), &why, Fallback::Nothing, reach);
                return;
            }
            _ => {}
        }
        if !p.admitted {
            self.admit(id);
        }
        let p = self.pending.get_mut(&id).expect("looked up above");
        let (tokens, mut end) = ev.into_parts();
        // Its engine stopped: the tokens it sent go out, then it moves.
        let lost = match &end {
            Some(EngineEvent::Failed(EngineFailure::EngineLost(why))) => {
                Some(format!("{}: {why}", self.workers[w].name))
            }
            _ => None,
        };
        if lost.is_some() {
            end = None;
        }
        let fresh = tokens.len().saturating_sub(skip);
        p.tokens_sent += fresh as u32;
        p.streamed.extend(tokens.iter().skip(skip).map(|s| s.token));
        if let Some(EngineEvent::Finished { usage, .. }) = &mut end
            && p.base > 0
        {
            // Moved: the client's usage counts its own prompt and every
            // token it was sent, from every placement.
            usage.prompt_tokens = p.prompt_len;
            usage.completion_tokens += p.base;
        }
        if fresh > 0 {
            // Moved with its KV: it took.
            let kv_from = if std::mem::take(&mut p.kv_move) {
                p.paired_prefill
            } else {
                None
            };
            self.prefill_done(id);
            if let Some(from) = kv_from {
                self.workers[from].moved_by_kv += 1;
            }
        }
        let ended = end.is_some();
        let events: Vec<EngineEvent> = tokens
            .into_iter()
            .skip(skip)
            .map(EngineEvent::Token)
            .chain(end)
            .collect();
        if !events.is_empty() {
            self.out.push(RouterOutput::Events { id, events });
        }
        if ended {
            self.finish(id);
        }
        if let Some(why) = lost {
            self.rerun_or_fail(id, Some(w), &why, Fallback::Nothing, reach);
        }
    }

    /// A request whose event batch never came: stop it on its node and
    /// end it with a clear error.
    fn lost_in_transit(&mut self, id: u64) {
        let Some(p) = self.finish(id) else {
            return;
        };
        self.cancel_on_node(&p, id, false);
        let msg = format!(
            "events of this request after token {} were lost between nodes",
            p.tokens_sent
        );
        tracing::warn!(req = id, "{msg}");
        self.fail(id, p, Rejection::Unavailable, EngineFailure::Internal(msg));
    }

    fn tick(&mut self, now: Duration, reach: &Reach) {
        // Clients that waited too long for their admission answer.
        let late: Vec<u64> = self
            .admit_by
            .iter()
            .take_while(|&&(d, _)| d <= now)
            .map(|&(_, id)| id)
            .collect();
        for id in late {
            if let Some(p) = self.finish(id) {
                let node = self.workers.get(p.worker).map_or("no node", |w| &w.name);
                tracing::info!(
                    "request {id} refused (unavailable): no admission answer from {node} in time"
                );
                self.cancel_on_node(&p, id, false);
                self.out.push(RouterOutput::Admitted {
                    id,
                    result: Err(Rejection::Unavailable),
                });
            }
        }
        if now < self.next_check {
            return;
        }
        let period = self.opts.heartbeat_interval / 4;
        while self.next_check <= now {
            self.next_check += period.max(Duration::from_micros(1));
        }
        self.check_silence(now, reach);
        if !self.parked.is_empty() {
            self.unpark(now, reach);
        }
        if self.checks_to_heartbeat == 0 {
            self.checks_to_heartbeat = 4;
            // Workers watch the Router the same way: a silent Router's
            // requests are cancelled on the workers.
            for i in 0..self.workers.len() {
                if self.workers[i].gone {
                    continue;
                }
                let node = self.workers[i].node;
                self.send(node, 0, Message::Heartbeat(EngineStatus::default()));
            }
            self.forget_silent(now);
            self.want_prefixes(now);
        }
        self.checks_to_heartbeat -= 1;
    }

    /// A node not in the config connected: known from now on, placed on
    /// once heard (its first heartbeat follows at once).
    fn joined(&mut self, now: Duration, peer: JoinedPeer) {
        if let Some(&w) = self.by_node.get(&peer.node) {
            let v = &mut self.workers[w];
            if v.name == peer.name && v.role == peer.role {
                // A reconnect (a restart, a new address): the same node.
                v.joined = Some((peer.addr, v.joined.as_ref().map_or(now, |j| j.1)));
            } else {
                tracing::warn!(
                    node = %peer.name,
                    "joined under the id of {} ({}): ignored",
                    v.name,
                    v.role
                );
            }
            return;
        }
        tracing::info!(node = %peer.name, role = %peer.role, addr = %peer.addr, "a node joined");
        let view = WorkerView::new(
            peer.node,
            peer.name,
            peer.role,
            self.opts.prefix_blocks_max,
            Some((peer.addr, now)),
        );
        // A forgotten node's slot first: nothing refers to it any more.
        let w = match self.workers.iter().position(|w| w.gone) {
            Some(w) => {
                self.workers[w] = view;
                w
            }
            None => {
                self.workers.push(view);
                self.workers.len() - 1
            }
        };
        self.by_node.insert(self.workers[w].node, w);
    }

    /// Where the joined node `w` is, if it joined at run time.
    fn joined_peer(&self, w: usize) -> Option<JoinedPeer> {
        let v = &self.workers[w];
        v.joined.as_ref().map(|(addr, _)| JoinedPeer {
            node: v.node,
            name: v.name.clone(),
            role: v.role,
            addr: addr.clone(),
        })
    }

    /// Joined nodes down (or never heard) for `forget_after`, with nothing
    /// in flight there: forgotten, their link dropped. A config node is
    /// never forgotten.
    fn forget_silent(&mut self, now: Duration) {
        for w in 0..self.workers.len() {
            let v = &self.workers[w];
            let Some((_, since)) = v.joined else { continue };
            let last = v.heard.map_or(since, |h| h.max(since));
            if v.gone || v.up || now.saturating_sub(last) < self.opts.forget_after {
                continue;
            }
            let referenced = v.in_flight > 0
                || v.prefilling > 0
                || self
                    .pending
                    .values()
                    .chain(self.parked.values().map(|(_, p, _)| p))
                    .any(|p| p.worker == w || p.prefill == Some(w) || p.paired_prefill == Some(w));
            if referenced {
                continue;
            }
            let node = v.node;
            tracing::info!(
                node = %v.name,
                "forgotten: not heard for {} s",
                now.saturating_sub(last).as_secs()
            );
            self.by_node.remove(&node);
            let v = &mut self.workers[w];
            v.gone = true;
            v.prefix = PrefixIndex::new(0);
            v.recall.clear();
            self.out.push(RouterOutput::Forget(node));
        }
    }

    /// A node up for two heartbeats whose prefix cache the index does not
    /// follow (its report was lost, or never came): ask for the whole.
    fn want_prefixes(&mut self, now: Duration) {
        let wait = self.opts.heartbeat_interval * 2;
        for i in 0..self.workers.len() {
            let v = &mut self.workers[i];
            if !v.up || v.prefix_seq.is_some() {
                continue;
            }
            match v.resync_asked {
                None => v.resync_asked = Some(now),
                Some(at) if now >= at + wait => {
                    v.resync_asked = Some(now);
                    let node = v.node;
                    self.send(node, 0, Message::PrefixResync);
                }
                Some(_) => {}
            }
        }
    }

    fn check_silence(&mut self, now: Duration, reach: &Reach) {
        let down_after = self.opts.down_after;
        // A gap in a request's events that outlasts the down bound is a
        // loss, not a reorder.
        let mut lost: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| {
                p.gap_since
                    .is_some_and(|g| now.saturating_sub(g) > down_after)
            })
            .map(|(&id, _)| id)
            .collect();
        // In request order, as a sorted map would give them.
        lost.sort_unstable();
        for id in lost {
            self.lost_in_transit(id);
        }
        for w in 0..self.workers.len() {
            let v = &self.workers[w];
            let silent = v.heard.is_none_or(|h| now.saturating_sub(h) > down_after);
            if v.up && silent {
                let ms = down_after.as_millis();
                tracing::warn!(node = %v.name, "no heartbeat for {ms} ms: marked down");
                self.workers[w].up = false;
                self.workers[w].downs += 1;
                self.worker_lost(
                    w,
                    &format!("stopped responding (no heartbeat for {ms} ms)"),
                    (false, true),
                    reach,
                );
            }
        }
    }
}

#[cfg(test)]
mod tests;
