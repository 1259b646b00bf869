//! The Router's cluster view: an [`Engine`] whose requests run on engine
//! nodes across the transport.
//!
//! The HTTP front (`flotilla-gateway`) drives this exactly as it drives an
//! engine in its own process; it cannot tell the difference. Behind it:
//!
//! - Membership: every engine node sends a heartbeat with its load each
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

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flotilla_proto::wire::{Held, LoadReport, Message, ReqEvents, SubmitMsg};
use flotilla_proto::wire::{WireEnd, WireFailure};
use flotilla_proto::{
    BoxFuture, Engine, EngineEvent, EngineFailure, EngineRequest, EngineStatus, KvUsage,
    NodeStatus, Rejection, RequestId, RequestStream, Role, TierStatus,
};
use flotilla_transport::{Inbound, NodeId, Transport};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

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
    /// Blocks remembered per worker by the prefix index.
    pub prefix_blocks_max: usize,
}

struct WorkerView {
    node: NodeId,
    name: String,
    role: Role,
    /// Prefills sent to this (prefill) node whose first token has not come.
    prefilling: u32,
    epoch: u64,
    heard: Option<Instant>,
    up: bool,
    load: LoadReport,
    in_flight: u32,
    in_flight_blocks: u64,
    routed: u64,
    downs: u64,
    prefix: PrefixIndex,
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
    tx: mpsc::UnboundedSender<EngineEvent>,
    admitted: Option<oneshot::Sender<Result<(), Rejection>>>,
    tokens_sent: u32,
    /// Event batches that came ahead of a missing one, by first index.
    early: BTreeMap<u32, ReqEvents>,
    /// Since when a batch has been missing.
    gap_since: Option<Instant>,
    blocks: u64,
    reruns: u32,
    req: EngineRequest,
}

/// Event batches one request may hold while one before them is missing.
const EARLY_MAX: usize = 256;

struct State {
    workers: Vec<WorkerView>,
    /// Index into `workers` by node id (every message looks its sender up).
    by_node: BTreeMap<NodeId, usize>,
    pending: BTreeMap<u64, Pending>,
}

struct Inner {
    transport: Arc<dyn Transport>,
    opts: RouterOptions,
    state: Mutex<State>,
    next_id: AtomicU64,
}

/// The Router's engine: requests go to engine nodes over the transport.
#[derive(Clone)]
pub struct ClusterEngine {
    inner: Arc<Inner>,
}

impl ClusterEngine {
    /// Starts the Router's inbound loop and heartbeat on the current tokio
    /// runtime.
    pub fn start(
        transport: Arc<dyn Transport>,
        inbound: mpsc::Receiver<Inbound>,
        opts: RouterOptions,
    ) -> ClusterEngine {
        let workers: Vec<WorkerView> = opts
            .workers
            .iter()
            .map(|(node, name, role)| WorkerView {
                node: *node,
                name: name.clone(),
                role: *role,
                prefilling: 0,
                epoch: 0,
                heard: None,
                up: false,
                load: LoadReport::default(),
                in_flight: 0,
                in_flight_blocks: 0,
                routed: 0,
                downs: 0,
                prefix: PrefixIndex::new(opts.prefix_blocks_max),
            })
            .collect();
        let inner = Arc::new(Inner {
            transport,
            opts,
            state: Mutex::new(State {
                by_node: workers
                    .iter()
                    .enumerate()
                    .map(|(i, w)| (w.node, i))
                    .collect(),
                workers,
                pending: BTreeMap::new(),
            }),
            next_id: AtomicU64::new(1),
        });
        tokio::spawn(inbound_loop(Arc::downgrade(&inner), inbound));
        tokio::spawn(watch_loop(Arc::downgrade(&inner)));
        ClusterEngine { inner }
    }

    /// Names of the nodes currently up.
    pub fn up_nodes(&self) -> Vec<String> {
        let st = self.inner.state.lock().expect("router state poisoned");
        st.workers
            .iter()
            .filter(|w| w.up)
            .map(|w| w.name.clone())
            .collect()
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("router state poisoned")
    }

    /// Whether node `i` can take work now.
    fn usable(&self, i: usize, w: &WorkerView, exclude: Option<usize>) -> bool {
        w.up && w.load.ready && Some(i) != exclude && self.transport.is_reachable(w.node)
    }

    /// The cheapest up node for a request, skipping `exclude`, and the
    /// prefill node to pair it with when it is a decode node.
    fn pick(
        &self,
        st: &State,
        hashes: &[u64],
        need_blocks: u64,
        exclude: Option<usize>,
        colocate: bool,
    ) -> Option<(usize, Option<usize>)> {
        let prefill = if colocate {
            None
        } else {
            st.workers
                .iter()
                .enumerate()
                .filter(|(i, w)| w.role == Role::Prefill && self.usable(*i, w, exclude))
                .min_by_key(|(_, w)| {
                    let compute = (hashes.len() - w.prefix.matched(hashes)) as u64;
                    (compute + w.in_flight_blocks, w.prefilling, w.routed)
                })
                .map(|(i, _)| i)
        };
        st.workers
            .iter()
            .enumerate()
            .filter(|(i, w)| w.role != Role::Prefill && self.usable(*i, w, exclude))
            .min_by_key(|(_, w)| {
                // A worker whose whole cache is too small comes last; if it
                // is the only one, its engine gives the client the reason.
                let too_small = w.load.kv_total != 0 && need_blocks > w.load.kv_total as u64;
                // A decode node paired with a prefill node computes no
                // prompt, but needs the blocks free now.
                let paired = w.role == Role::Decode && prefill.is_some();
                let short = paired && need_blocks > u64::from(w.load.kv_free);
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
            .map(|(i, w)| (i, prefill.filter(|_| w.role == Role::Decode)))
    }

    /// Picks a node (and prefill node) for pending request `id` and sends
    /// it there; tries a second node if the first cannot be reached.
    fn route(&self, st: &mut State, id: u64, hashes: &[u64], exclude: Option<usize>) -> bool {
        let (need, colocate) = {
            let p = &st.pending[&id];
            (p.blocks, p.colocate)
        };
        let mut skip = exclude;
        loop {
            let Some((w, prefill)) = self.pick(st, hashes, need, skip, colocate) else {
                return false;
            };
            if self.dispatch(st, w, prefill, id, hashes).is_ok() {
                return true;
            }
            if skip.is_some() {
                return false;
            }
            skip = Some(w);
        }
    }

    /// Sends `req` (under the Router's id `id`) to worker `w`, naming
    /// `prefill` as the node that computes its prompt, and books it.
    fn dispatch(
        &self,
        st: &mut State,
        w: usize,
        prefill: Option<usize>,
        id: u64,
        hashes: &[u64],
    ) -> Result<(), ()> {
        let p = st.pending.get(&id).expect("dispatch of an unknown request");
        let mut submit = SubmitMsg::from_request(id, &p.req);
        submit.attempt = p.reruns;
        submit.prefill = prefill.map(|i| st.workers[i].node);
        let blocks = p.blocks;
        let node = st.workers[w].node;
        if let Err(e) = self.transport.send(node, id, Message::Submit(submit)) {
            tracing::warn!("{e}");
            return Err(());
        }
        let view = &mut st.workers[w];
        view.in_flight += 1;
        view.in_flight_blocks += blocks;
        view.routed += 1;
        let epoch = view.epoch;
        match prefill {
            Some(pi) => {
                let pv = &mut st.workers[pi];
                pv.prefilling += 1;
                pv.routed += 1;
                pv.prefix.insert(hashes);
            }
            None => st.workers[w].prefix.insert(hashes),
        }
        let p = st.pending.get_mut(&id).expect("checked above");
        p.worker = w;
        p.epoch = epoch;
        p.prefill = prefill;
        p.paired_prefill = prefill;
        // Held batches of an earlier run are not this run's.
        p.early.clear();
        p.gap_since = None;
        Ok(())
    }

    /// The first token of `id` came (or it ended): its prefill node is done.
    fn prefill_done(st: &mut State, id: u64) {
        if let Some(p) = st.pending.get_mut(&id)
            && let Some(pi) = p.prefill.take()
        {
            let pv = &mut st.workers[pi];
            pv.prefilling = pv.prefilling.saturating_sub(1);
        }
    }

    /// Removes a request and gives back its share of its worker's load.
    fn finish(&self, st: &mut State, id: u64) -> Option<Pending> {
        Self::prefill_done(st, id);
        let p = st.pending.remove(&id)?;
        let w = &mut st.workers[p.worker];
        w.in_flight = w.in_flight.saturating_sub(1);
        w.in_flight_blocks = w.in_flight_blocks.saturating_sub(p.blocks);
        Some(p)
    }

    /// The client no longer wants request `id` (disconnect, stop string,
    /// admission timeout): forget it and tell its worker, if it still runs.
    fn abandon(&self, id: u64, stop_string: bool) {
        let mut st = self.lock();
        if let Some(p) = self.finish(&mut st, id) {
            let node = st.workers[p.worker].node;
            let cancel = Message::Cancel {
                req: id,
                stop_string,
                attempt: p.reruns,
            };
            let _ = self.transport.send(node, id, cancel);
        }
    }

    /// Worker `w` is gone (silent, or restarted with a new epoch): re-run
    /// what produced nothing yet, fail the rest. Requests whose prompt it
    /// was computing for a decode node are cancelled there and re-run.
    fn worker_lost(&self, st: &mut State, w: usize, why: &str) {
        let ids: Vec<u64> = st
            .pending
            .iter()
            .filter(|(_, p)| {
                (p.worker == w && p.epoch <= st.workers[w].epoch)
                    || (p.prefill == Some(w) && p.tokens_sent == 0)
            })
            .map(|(id, _)| *id)
            .collect();
        st.workers[w].prefix.clear();
        let name = st.workers[w].name.clone();
        for id in ids {
            let p = &st.pending[&id];
            if p.worker == w
                && let Some(pf) = p.paired_prefill.filter(|&pf| pf != w)
            {
                // The lost decode node will never ack or cancel the KV its
                // prefill node holds for it: without this the blocks stay
                // leased there until the hold deadline.
                let abandon = Message::PrefillAbandon {
                    decode: st.workers[w].node,
                    decode_epoch: p.epoch,
                    req: id,
                };
                let _ = self.transport.send(st.workers[pf].node, id, abandon);
            }
            // Stop it where it was placed before it runs again: a decode
            // node that is fine frees its reservation, and a node that only
            // seems lost (our direction of the link still works) frees its
            // blocks now instead of at its own deadline.
            let cancel = Message::Cancel {
                req: id,
                stop_string: false,
                attempt: p.reruns,
            };
            let _ = self.transport.send(st.workers[p.worker].node, id, cancel);
            self.rerun_or_fail(st, id, Some(w), &format!("{name} {why}"));
        }
    }

    /// Runs `id` again elsewhere if no token reached its client yet (and
    /// it has re-runs left), else ends it with `why`.
    fn rerun_or_fail(&self, st: &mut State, id: u64, exclude: Option<usize>, why: &str) {
        let Some(mut p) = self.finish(st, id) else {
            return;
        };
        if p.tokens_sent == 0 && p.reruns < self.opts.reruns_max {
            p.reruns += 1;
            let hashes = self.hashes(&p.req);
            st.pending.insert(id, p);
            if self.route(st, id, &hashes, exclude) {
                let to = &st.workers[st.pending[&id].worker].name;
                tracing::info!("request {id}: {why}; re-running it on {to}");
                return;
            }
            p = st.pending.remove(&id).expect("inserted above");
        }
        let msg = format!(
            "worker {why} after {} tokens of this request were sent; no other \
             worker could take it over",
            p.tokens_sent
        );
        fail(p, Rejection::Unavailable, EngineFailure::Internal(msg));
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

    fn on_message(&self, from: NodeId, epoch: u64, msg: Message) {
        let mut st = self.lock();
        let Some(&w) = st.by_node.get(&from) else {
            return;
        };
        if epoch > st.workers[w].epoch {
            if st.workers[w].epoch != 0 {
                // Our link still reaches its old life: frames sent there
                // would vanish until the idle timeout.
                self.transport.reconnect(from);
                self.worker_lost(&mut st, w, "restarted");
                tracing::info!(node = %st.workers[w].name, "rejoined with a new epoch");
            }
            st.workers[w].epoch = epoch;
        }
        let view = &mut st.workers[w];
        view.heard = Some(Instant::now());
        if !view.up {
            tracing::info!(node = %view.name, "up");
        }
        view.up = true;
        match msg {
            Message::Heartbeat(load) => st.workers[w].load = load,
            Message::Holding { held } => {
                // What it still holds that we no longer run there (we ended
                // or moved it while it was cut off), or prefill KV kept for
                // a decode node that no longer has the request.
                let known = |h: &Held| {
                    st.pending.get(&h.req).is_some_and(|p| match h.for_decode {
                        None => p.worker == w,
                        Some(d) => p.paired_prefill == Some(w) && st.workers[p.worker].node == d,
                    })
                };
                let unknown: Vec<Held> = held.into_iter().filter(|h| !known(h)).collect();
                if !unknown.is_empty() {
                    let _ = self
                        .transport
                        .send(from, 0, Message::Unknown { held: unknown });
                }
            }
            Message::Admitted { req } => {
                if let Some(p) = st.pending.get_mut(&req)
                    && p.worker == w
                    && let Some(a) = p.admitted.take()
                {
                    let _ = a.send(Ok(()));
                }
            }
            Message::Refused { req, rejection } => {
                if st.pending.get(&req).is_none_or(|p| p.worker != w) {
                    return;
                }
                let r = Rejection::from(rejection);
                // A decode node without blocks to reserve: another node
                // (or a colocated run) may have them.
                let full = matches!(r, Rejection::QueueFull { .. } | Rejection::Unavailable);
                if full && st.pending[&req].prefill.is_some() {
                    let why = format!("{} refused it ({r})", st.workers[w].name);
                    self.rerun_or_fail(&mut st, req, Some(w), &why);
                } else if let Some(p) = self.finish(&mut st, req) {
                    let f = EngineFailure::Internal(format!("re-run refused: {r}"));
                    fail(p, r, f);
                }
            }
            Message::Events(batch) => {
                for ev in batch {
                    let ours = st
                        .pending
                        .get(&ev.req)
                        .is_some_and(|p| p.worker == w && p.reruns == ev.attempt);
                    if !ours {
                        // Work this Router no longer wants (it was failed or
                        // moved while the node was unreachable): stop it.
                        if ev.end.is_none() {
                            let _ = self.transport.send(
                                from,
                                ev.req,
                                Message::Cancel {
                                    req: ev.req,
                                    stop_string: false,
                                    // That placement (a later one there
                                    // may be the current one).
                                    attempt: ev.attempt,
                                },
                            );
                        }
                        continue;
                    }
                    let req = ev.req;
                    let p = st.pending.get_mut(&req).expect("checked above");
                    if ev.first > p.tokens_sent {
                        // A batch before it is missing (reordered, or
                        // lost): hold this one until the gap fills.
                        if p.early.len() >= EARLY_MAX {
                            self.lost_in_transit(&mut st, req);
                            continue;
                        }
                        p.gap_since.get_or_insert_with(Instant::now);
                        p.early.insert(ev.first, ev);
                        continue;
                    }
                    let mut next = Some(ev);
                    while let Some(ev) = next.take() {
                        self.apply_events(&mut st, w, ev);
                        let Some(p) = st.pending.get_mut(&req) else {
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
            }
            _ => {}
        }
    }

    /// Delivers one in-order batch (`first <= tokens_sent`): the tokens
    /// the client has not had yet, then the end, if any.
    fn apply_events(&self, st: &mut State, w: usize, ev: ReqEvents) {
        let Some(p) = st.pending.get_mut(&ev.req) else {
            return;
        };
        if p.tokens_sent == 0
            && let Some(WireEnd::Failed(WireFailure::KvTransfer(why))) = &ev.end
        {
            // Nothing reached the client: run it again, whole on one node
            // this time.
            p.colocate = true;
            let why = format!("{}: KV transfer failed: {why}", st.workers[w].name);
            self.rerun_or_fail(st, ev.req, None, &why);
            return;
        }
        if let Some(WireEnd::Failed(WireFailure::RouterLost(why))) = &ev.end {
            // The node stopped hearing us (our direction of the link was
            // cut) and dropped it: the client's tokens so far are all it
            // will get from there.
            let why = format!("{} dropped it: {why}", st.workers[w].name);
            let skip = (p.tokens_sent - ev.first) as usize;
            if ev.tokens.len() <= skip {
                self.rerun_or_fail(st, ev.req, Some(w), &why);
                return;
            }
        }
        if let Some(a) = p.admitted.take() {
            let _ = a.send(Ok(()));
        }
        // A duplicate's tokens the client already has.
        let skip = (p.tokens_sent - ev.first) as usize;
        let fresh = ev.tokens.len().saturating_sub(skip);
        p.tokens_sent += fresh as u32;
        if fresh > 0 {
            Self::prefill_done(st, ev.req);
        }
        let p = st.pending.get_mut(&ev.req).expect("checked above");
        for t in ev.tokens.into_iter().skip(skip) {
            let _ = p.tx.send(EngineEvent::Token(t.into()));
        }
        if let Some(end) = ev.end {
            let _ = p.tx.send(end.into_event());
            self.finish(st, ev.req);
        }
    }

    /// A request whose event batch never came: stop it on its node and
    /// end it with a clear error.
    fn lost_in_transit(&self, st: &mut State, req: u64) {
        let Some(p) = self.finish(st, req) else {
            return;
        };
        let node = st.workers[p.worker].node;
        let cancel = Message::Cancel {
            req,
            stop_string: false,
            attempt: p.reruns,
        };
        let _ = self.transport.send(node, req, cancel);
        let msg = format!(
            "events of this request after token {} were lost between nodes",
            p.tokens_sent
        );
        tracing::warn!(req, "{msg}");
        fail(p, Rejection::Unavailable, EngineFailure::Internal(msg));
    }

    fn check_silence(&self) {
        let mut st = self.lock();
        let now = Instant::now();
        // A gap in a request's events that outlasts the down bound is a
        // loss, not a reorder.
        let lost: Vec<u64> = st
            .pending
            .iter()
            .filter(|(_, p)| {
                p.gap_since
                    .is_some_and(|g| now.duration_since(g) > self.opts.down_after)
            })
            .map(|(&id, _)| id)
            .collect();
        for id in lost {
            self.lost_in_transit(&mut st, id);
        }
        for w in 0..st.workers.len() {
            let v = &st.workers[w];
            let silent = v
                .heard
                .is_none_or(|h| now.duration_since(h) > self.opts.down_after);
            if v.up && silent {
                let ms = self.opts.down_after.as_millis();
                tracing::warn!(node = %v.name, "no heartbeat for {ms} ms: marked down");
                st.workers[w].up = false;
                st.workers[w].downs += 1;
                self.worker_lost(
                    &mut st,
                    w,
                    &format!("stopped responding (no heartbeat for {ms} ms)"),
                );
            }
        }
    }
}

/// Ends a request that failed: a refusal if the client is still waiting
/// for admission, else a failure event on its stream.
fn fail(mut p: Pending, r: Rejection, f: EngineFailure) {
    match p.admitted.take() {
        Some(a) => {
            let _ = a.send(Err(r));
        }
        None => {
            let _ = p.tx.send(EngineEvent::Failed(f));
        }
    }
}

async fn inbound_loop(inner: std::sync::Weak<Inner>, mut inbound: mpsc::Receiver<Inbound>) {
    while let Some(m) = inbound.recv().await {
        let Some(inner) = inner.upgrade() else { return };
        if let Inbound::Message {
            from, epoch, msg, ..
        } = m
        {
            inner.on_message(from, epoch, msg);
        }
    }
}

async fn watch_loop(inner: std::sync::Weak<Inner>) {
    let period = match inner.upgrade() {
        Some(i) => i.opts.heartbeat_interval,
        None => return,
    };
    // Silence is checked four times per heartbeat interval, so a node is
    // marked down at most a quarter interval after its bound passes.
    let mut tick = tokio::time::interval(period / 4);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    for n in 0u64.. {
        tick.tick().await;
        let Some(inner) = inner.upgrade() else { return };
        inner.check_silence();
        if n % 4 != 0 {
            continue;
        }
        // Workers watch the Router the same way: a silent Router's requests
        // are cancelled on the workers.
        let nodes: Vec<NodeId> = inner.lock().workers.iter().map(|w| w.node).collect();
        for n in nodes {
            let _ = inner
                .transport
                .send(n, 0, Message::Heartbeat(LoadReport::default()));
        }
    }
}

impl Engine for ClusterEngine {
    fn submit(&self, req: EngineRequest) -> BoxFuture<Result<RequestStream, Rejection>> {
        let inner = self.inner.clone();
        Box::pin(async move {
            let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
            let hashes = inner.hashes(&req);
            let blocks = (req.prompt.len() as u64 + req.max_tokens as u64)
                .div_ceil(inner.opts.block_size.max(1) as u64);
            let (tx, rx) = mpsc::unbounded_channel();
            let (atx, arx) = oneshot::channel();
            {
                let mut st = inner.lock();
                st.pending.insert(
                    id,
                    Pending {
                        worker: 0,
                        epoch: 0,
                        prefill: None,
                        paired_prefill: None,
                        colocate: false,
                        tx,
                        admitted: Some(atx),
                        tokens_sent: 0,
                        early: BTreeMap::new(),
                        gap_since: None,
                        blocks,
                        reruns: 0,
                        req,
                    },
                );
                if !inner.route(&mut st, id, &hashes, None) {
                    st.pending.remove(&id);
                    return Err(Rejection::Unavailable);
                }
            }
            // Admission is answered within one round trip; a node that dies
            // first is noticed by silence and the request re-run or refused,
            // which also answers here. The timeout is a last resort.
            let wait = inner.opts.down_after * 3 + Duration::from_secs(5);
            let answer = tokio::time::timeout(wait, arx).await;
            match answer {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(r))) => return Err(r),
                _ => {
                    inner.abandon(id, false);
                    return Err(Rejection::Unavailable);
                }
            }
            let weak = Arc::downgrade(&inner);
            let on_drop = Box::new(move |stop_string: bool| {
                if let Some(inner) = weak.upgrade() {
                    inner.abandon(id, stop_string);
                }
            });
            Ok(RequestStream::new(RequestId(id), rx, on_drop))
        })
    }

    fn status(&self) -> BoxFuture<EngineStatus> {
        let inner = self.inner.clone();
        Box::pin(async move {
            let st = inner.lock();
            let mut s = EngineStatus::default();
            let mut tiers: Vec<TierStatus> = Vec::new();
            for w in &st.workers {
                s.nodes.push(NodeStatus {
                    name: w.name.clone(),
                    up: w.up,
                    epoch: w.epoch,
                    in_flight: w.in_flight,
                    routed: w.routed,
                    downs: w.downs,
                    kv_orphans: w.load.kv_orphans,
                });
                if !w.up {
                    continue;
                }
                let l = &w.load;
                s.ready |= l.ready;
                s.steps += l.steps;
                s.running += l.running as usize;
                s.preemptions += l.preemptions;
                s.kv = KvUsage {
                    total: s.kv.total + l.kv_total,
                    free: s.kv.free + l.kv_free,
                    used: s.kv.used + l.kv_used,
                    cached: s.kv.cached + l.kv_cached,
                    held: s.kv.held + l.kv_held,
                    reserved: s.kv.reserved + l.kv_reserved,
                };
                for t in &l.tiers {
                    match tiers.iter_mut().find(|x| x.name == t.name) {
                        Some(x) => {
                            x.queued += t.queued as usize;
                            x.running += t.running as usize;
                        }
                        None => tiers.push(TierStatus {
                            name: t.name.clone(),
                            queued: t.queued as usize,
                            running: t.running as usize,
                        }),
                    }
                }
            }
            s.tiers = tiers;
            s
        })
    }
}
