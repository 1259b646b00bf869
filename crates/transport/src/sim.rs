//! The simulated network: a [`Transport`] whose messages take a modelled
//! latency (and bulk transfers a modelled bandwidth) on the paused clock,
//! with the faults a scenario enables. Every fault that fires is counted.
//!
//! The faults follow what QUIC does with them, since that is what the
//! production transport gives the protocol above it:
//! - packet loss: the message is retransmitted after a probe timeout, and
//!   everything behind it on the link waits (the control stream is ordered);
//! - a partition or a clogged link holds messages; one that lasts longer
//!   than the idle timeout closes the connection and drops what it held;
//! - a crash drops the node's inbox and what is in flight to it.
//!
//! Duplication and reordering go beyond QUIC (its streams deliver once, in
//! order): they test the protocol's own defences (token indices, idempotent
//! submits and cancels) against a peer that resends after a reconnect.
//!
//! What travels is the encoded frame, not the Rust value: a send goes
//! through the same encoder, frame cap and role policy as QUIC
//! ([`crate::frames`]), and every delivery through the same
//! validating decoder and sender checks, so a simulation catches a wire
//! bug (a message over the cap, a kind a role may not send, a payload that
//! does not round-trip). Refused frames are counted; the run fails on any.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::frames::{accept_frame, encode_checked};
use crate::{
    BoxFuture, BulkError, Inbound, NodeId, SendError, SendFailure, Sink, Transport, TransportStats,
    live_peer,
};
use bytes::Bytes;
use flotilla_proto::Role;
use flotilla_proto::wire::{KvTransferHeader, Message};
use serde::Deserialize;
use tokio::sync::mpsc;
use tokio::time::Instant;

use flotilla_exec::rng::Rng;

/// Link figures and the per-message fault rates.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LinkConfig {
    /// One-way latency, microseconds.
    pub latency_us: u64,
    /// Extra latency drawn uniformly in `0..=jitter_us`.
    pub jitter_us: u64,
    /// Bulk bandwidth, bytes per second.
    pub bandwidth: f64,
    /// Probability that a control message's packet is lost (and resent).
    pub loss: f64,
    /// Probability that a control message arrives twice.
    pub duplicate: f64,
    /// Probability that a control message skips the per-link order.
    pub reorder: f64,
    /// A link that carries nothing for this long closes, dropping what it
    /// held, ms (QUIC's idle timeout; a scenario sets it as the cluster
    /// config does, `[cluster] idle_timeout_ms`).
    #[serde(skip)]
    pub idle_timeout_ms: u64,
    /// Cap on one frame's payload, bytes (`[cluster] frame_len_max_bytes`
    /// of the scenario, as of a cluster config): the engine nodes split
    /// event batches below it.
    #[serde(skip)]
    pub frame_len_max_bytes: u32,
    /// Bytes a migrated token's KV really has (set from the model: the
    /// simulated blocks carry stand-in bytes, transfers take the real time).
    #[serde(skip)]
    pub kv_bytes_per_token: u64,
}

impl Default for LinkConfig {
    fn default() -> Self {
        LinkConfig {
            latency_us: 50,
            jitter_us: 20,
            bandwidth: 12.5e9,
            loss: 0.0,
            duplicate: 0.0,
            reorder: 0.0,
            idle_timeout_ms: 10_000,
            frame_len_max_bytes: 1 << 20,
            kv_bytes_per_token: 0,
        }
    }
}

/// Faults that fired, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultCounts {
    /// Control messages whose packet was lost and resent.
    pub lost: u64,
    /// Control messages delivered twice.
    pub duplicated: u64,
    /// Control messages delivered out of order.
    pub reordered: u64,
    /// Messages held by a partition.
    pub partitioned: u64,
    /// Messages held by a clogged link.
    pub clogged: u64,
    /// Messages dropped because a held link outlasted the idle timeout.
    pub dropped: u64,
    /// Nodes crashed.
    pub crashes: u64,
    /// Nodes restarted.
    pub restarts: u64,
    /// Routers crashed (not counted in `crashes`).
    pub router_crashes: u64,
    /// Routers restarted.
    pub router_restarts: u64,
    /// Pipeline stages crashed (their groups' nodes stay up).
    pub stage_crashes: u64,
    /// Pipeline stages back.
    pub stage_restarts: u64,
    /// Drains started (a running node was told to drain).
    pub drains: u64,
    /// Nodes that drained and left.
    pub drained: u64,
    /// Nodes not in the config that joined (started, a first time or again).
    pub joins: u64,
    /// Control messages sent (copies included): how many chances the
    /// per-message faults had.
    pub messages: u64,
    /// KV transfers started (not a fault: counted with them for the report).
    pub transfers: u64,
    /// Transfers to a crashed node that hung until the idle timeout.
    pub transfers_hung: u64,
    /// Their modelled bytes.
    pub transfer_bytes: u64,
    /// Frames refused by the codec or the sender checks (not a fault: a
    /// wire bug; the run fails on any).
    pub frames_refused: u64,
    /// Frame bytes carried (envelopes and payloads, copies included).
    pub frame_bytes: u64,
}

/// What crosses a link: encoded frames, as on a QUIC stream.
enum Wire {
    /// One control frame.
    Frame { from: NodeId, frame: Bytes },
    /// A bulk transfer: its header frame, then its bytes.
    Bulk {
        from: NodeId,
        frame: Bytes,
        data: Bytes,
    },
}

/// A message on its way: when it arrives, to which life of its node.
type Delivery = (Instant, u64, Wire);

struct NodeSlot {
    epoch: u64,
    /// Where this life's arrivals go (its actor's mailbox).
    inbox: Sink,
}

struct NetState {
    nodes: Vec<Option<NodeSlot>>,
    /// Each node's role: the role policy on both ends.
    roles: Vec<Role>,
    /// The last refused frame, for the run's error.
    refused: Option<String>,
    link: LinkConfig,
    rng: Rng,
    /// Keys each message's jitter ([`NetState::jitter`]).
    jitter_salt: u64,
    /// When the network was made: the origin of jitter's times.
    t0: Instant,
    /// Directed links that drop everything.
    cut: BTreeSet<(NodeId, NodeId)>,
    /// Directed links that hold everything until they are unclogged.
    clogged: BTreeSet<(NodeId, NodeId)>,
    /// When the last message on each directed link arrives (FIFO order).
    last_arrival: BTreeMap<(NodeId, NodeId), Instant>,
    /// Each directed link's in-order deliveries: one task per link, not
    /// one per message.
    queues: BTreeMap<(NodeId, NodeId), mpsc::UnboundedSender<Delivery>>,
    /// Nodes that are not in the config: a Router hears `Inbound::Joined`
    /// before the first message of each of their lives (as the QUIC
    /// transport announces a new connection from one).
    joiners: BTreeSet<NodeId>,
    /// (Router, its epoch, joiner, its epoch) announced.
    announced: BTreeSet<(NodeId, u64, NodeId, u64)>,
    /// When each node last crashed, until it joins again: a QUIC sender
    /// learns of that only when its connection idles out.
    crashed_at: BTreeMap<NodeId, Instant>,
    faults: FaultCounts,
}

/// The network of one simulation run.
pub struct SimNet {
    st: Mutex<NetState>,
}

/// One node's end of a [`SimNet`].
pub struct SimTransport {
    net: Arc<SimNet>,
    node: NodeId,
    epoch: u64,
}

impl SimNet {
    /// Nodes of `roles` (node id = index), none joined; random choices
    /// from `rng`.
    pub fn new(roles: Vec<Role>, link: LinkConfig, rng: Rng) -> Arc<SimNet> {
        Arc::new(SimNet {
            st: Mutex::new(NetState {
                nodes: roles.iter().map(|_| None).collect(),
                roles,
                refused: None,
                link,
                jitter_salt: rng.split(0x6a17).next_u64(),
                t0: Instant::now(),
                rng,
                cut: BTreeSet::new(),
                clogged: BTreeSet::new(),
                last_arrival: BTreeMap::new(),
                queues: BTreeMap::new(),
                crashed_at: BTreeMap::new(),
                joiners: BTreeSet::new(),
                announced: BTreeSet::new(),
                faults: FaultCounts::default(),
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, NetState> {
        self.st
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Node `node` (re)joins at `epoch`, its arrivals to `sink`; a life
    /// still joined is told it is over ([`Inbound::Closed`]).
    pub fn join(self: &Arc<SimNet>, node: NodeId, epoch: u64, sink: Sink) -> Arc<SimTransport> {
        let mut st = self.lock();
        let old = st.nodes[node as usize].replace(NodeSlot { epoch, inbox: sink });
        st.crashed_at.remove(&node);
        drop(st);
        if let Some(old) = old {
            old.inbox.deliver(Inbound::Closed);
        }
        Arc::new(SimTransport {
            net: self.clone(),
            node,
            epoch,
        })
    }

    /// Node `node` crashes: nothing in flight reaches it, nothing it sends
    /// arrives, and it is told its transport closed.
    pub fn crash(&self, node: NodeId) {
        let mut st = self.lock();
        let Some(old) = st.nodes[node as usize].take() else {
            return;
        };
        if st.roles[node as usize] == Role::Router {
            st.faults.router_crashes += 1;
        } else {
            st.faults.crashes += 1;
        }
        st.crashed_at.insert(node, Instant::now());
        drop(st);
        old.inbox.deliver(Inbound::Closed);
    }

    /// Node `node`'s life `epoch` drained and leaves: like a crash for
    /// what comes later, but what it sent before arrives.
    pub fn leave(&self, node: NodeId, epoch: u64) {
        let mut st = self.lock();
        if st.nodes[node as usize]
            .as_ref()
            .is_some_and(|s| s.epoch == epoch)
        {
            if let Some(old) = st.nodes[node as usize].take() {
                old.inbox.deliver(Inbound::Closed);
            }
            st.faults.drained += 1;
        }
    }

    /// Nodes `nodes` are not in the config: they join at run time.
    pub fn set_joiners(&self, nodes: impl IntoIterator<Item = NodeId>) {
        self.lock().joiners = nodes.into_iter().collect();
    }

    /// Counts a join (the caller starts the node).
    pub fn note_join(&self) {
        self.lock().faults.joins += 1;
    }

    /// Counts a drain started.
    pub fn note_drain(&self) {
        self.lock().faults.drains += 1;
    }

    /// Counts a restart (the caller joins the node again with a new epoch).
    pub fn note_restart(&self) {
        self.lock().faults.restarts += 1;
    }

    /// Counts a Router's restart.
    pub fn note_router_restart(&self) {
        self.lock().faults.router_restarts += 1;
    }

    /// Counts a pipeline stage's crash (the simulator models the stage
    /// links inside its group's executor, not on this network).
    pub fn note_stage_crash(&self) {
        self.lock().faults.stage_crashes += 1;
    }

    /// Counts a pipeline stage coming back.
    pub fn note_stage_restart(&self) {
        self.lock().faults.stage_restarts += 1;
    }

    /// Cuts the link `a -> b`, and `b -> a` too if `both`.
    pub fn partition(&self, a: NodeId, b: NodeId, both: bool) {
        let mut st = self.lock();
        st.cut.insert((a, b));
        if both {
            st.cut.insert((b, a));
        }
    }

    /// Restores every cut link.
    pub fn heal(&self) {
        self.lock().cut.clear();
    }

    /// Holds every message on `a -> b` until [`SimNet::unclog`].
    pub fn clog(&self, a: NodeId, b: NodeId) {
        self.lock().clogged.insert((a, b));
    }

    /// The clogged links in a random order (for a swizzle-clog release).
    pub fn clogged_in_random_order(&self) -> Vec<(NodeId, NodeId)> {
        let mut st = self.lock();
        let mut links: Vec<_> = st.clogged.iter().copied().collect();
        for i in (1..links.len()).rev() {
            let j = st.rng.range(0, i as u64) as usize;
            links.swap(i, j);
        }
        links
    }

    /// Opens the clogged link `a -> b`: what it held is delivered.
    pub fn unclog(&self, a: NodeId, b: NodeId) {
        self.lock().clogged.remove(&(a, b));
    }

    /// Faults fired so far.
    pub fn faults(&self) -> FaultCounts {
        self.lock().faults
    }

    /// The last frame the codec or the sender checks refused, if any.
    pub fn refused_frame(&self) -> Option<String> {
        self.lock().refused.clone()
    }

    /// Queues `inbound` on `link` for `at`; `at` never goes backwards on a
    /// link (FIFO), so one task per link sleeps to each in turn.
    fn enqueue(self: &Arc<Self>, st: &mut NetState, link: (NodeId, NodeId), d: Delivery) {
        let tx = st.queues.entry(link).or_insert_with(|| {
            let (tx, mut rx) = mpsc::unbounded_channel::<Delivery>();
            let net = self.clone();
            tokio::spawn(async move {
                while let Some((at, epoch, wire)) = rx.recv().await {
                    tokio::time::sleep_until(at).await;
                    net.lock().deliver(link.1, epoch, wire);
                }
            });
            tx
        });
        let _ = tx.send(d);
    }

    /// Delivers `wire` to `to`'s current life (`epoch`) at `at`.
    fn deliver_at(self: &Arc<Self>, to: NodeId, epoch: u64, at: Instant, wire: Wire) {
        let net = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep_until(at).await;
            net.lock().deliver(to, epoch, wire);
        });
    }
}

impl NetState {
    /// Hands `wire` to `to` if its life `epoch` still runs (crashed, or
    /// restarted since: the message is lost with the old life), decoded
    /// and checked as QUIC's receiver checks it.
    fn deliver(&mut self, to: NodeId, epoch: u64, wire: Wire) {
        if self.nodes[to as usize]
            .as_ref()
            .is_none_or(|s| s.epoch != epoch)
        {
            return;
        }
        let cap = self.link.frame_len_max_bytes;
        let (from, frame, data) = match wire {
            Wire::Frame { from, frame } => (from, frame, None),
            Wire::Bulk { from, frame, data } => (from, frame, Some(data)),
        };
        let role = self.roles[from as usize];
        let inbound = match (accept_frame(&frame, cap, from, role), data) {
            (Ok((h, Message::KvBlocks(header))), Some(data)) => Inbound::Bulk {
                from,
                epoch: h.epoch,
                header,
                data: vec![data],
            },
            (Ok((h, msg)), None) if !matches!(msg, Message::KvBlocks(_)) => Inbound::Message {
                from,
                epoch: h.epoch,
                correlation: h.correlation,
                msg,
            },
            (Ok((h, _)), _) => {
                return self.refuse(format!("{:?} frame on the wrong stream", h.kind));
            }
            (Err(e), _) => return self.refuse(format!("from node {from} to node {to}: {e}")),
        };
        if let Inbound::Message { from, epoch, .. } = &inbound
            && self.joiners.contains(from)
            && self.roles[to as usize] == Role::Router
            && self
                .announced
                .insert((to, to_epoch_of(&self.nodes, to), *from, *epoch))
            && let Some(slot) = &self.nodes[to as usize]
        {
            slot.inbox
                .deliver(Inbound::Joined(flotilla_proto::wire::JoinedPeer {
                    node: *from,
                    name: format!("engine-{from}"),
                    role,
                    addr: String::new(),
                }));
        }
        if let Some(slot) = &self.nodes[to as usize] {
            slot.inbox.deliver(inbound);
        }
    }

    fn refuse(&mut self, why: String) {
        tracing::error!("frame refused: {why}");
        self.faults.frames_refused += 1;
        self.refused = Some(why);
    }
}

/// The life of `to` now (0: none).
fn to_epoch_of(nodes: &[Option<NodeSlot>], to: NodeId) -> u64 {
    nodes[to as usize].as_ref().map_or(0, |s| s.epoch)
}

impl NetState {
    /// A message's jitter, us: a function of its link and the time it is
    /// sent, not a draw in turn, so that a message sent at the same time
    /// on the same link is delayed the same however many others were sent
    /// before it elsewhere (fast mode sends fewer token messages than the
    /// exact mode, and must not move every later message by it).
    fn jitter(&self, (from, to): (NodeId, NodeId), now: Instant) -> u64 {
        let j = self.link.jitter_us;
        if j == 0 {
            return 0;
        }
        let t = now.saturating_duration_since(self.t0).as_nanos() as u64;
        let mut x =
            self.jitter_salt ^ u64::from(from).rotate_left(40) ^ u64::from(to).rotate_left(20) ^ t;
        // SplitMix64's finaliser.
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^= x >> 31;
        x % (j + 1)
    }

    /// Until when a transfer to `to` waits before it fails: a node that
    /// crashed (and has not come back: a new life answers at once) is
    /// noticed by QUIC only when the connection idles out, so the transfer
    /// hangs until then, holding what it holds on the sender.
    fn hang_until(&mut self, to: NodeId) -> Option<Instant> {
        let at = *self.crashed_at.get(&to)?;
        let until = at + Duration::from_millis(self.link.idle_timeout_ms);
        (until > Instant::now()).then(|| {
            self.faults.transfers_hung += 1;
            until
        })
    }
}

/// `why`, once `hang` (if any) has passed.
async fn fail_after(hang: Option<Instant>, why: SendFailure) -> BulkError {
    if let Some(t) = hang {
        tokio::time::sleep_until(t).await;
    }
    BulkError::Send(why)
}

impl SimTransport {
    fn alive(&self, st: &NetState) -> bool {
        st.nodes[self.node as usize]
            .as_ref()
            .is_some_and(|s| s.epoch == self.epoch)
    }
}

/// A clogged link is polled this often until it opens.
const CLOG_POLL: Duration = Duration::from_millis(5);

impl Transport for SimTransport {
    fn node(&self) -> NodeId {
        self.node
    }

    fn epoch(&self) -> u64 {
        self.epoch
    }

    fn send(&self, to: NodeId, correlation: u64, msg: Message) -> Result<(), SendError> {
        let mut st = self.net.lock();
        let to_epoch = match live_peer(self.alive(&st), &st.nodes, to) {
            Ok(slot) => slot.epoch,
            Err(reason) => return Err(SendError::new(to, reason, msg)),
        };
        let role = st.roles[self.node as usize];
        let frame = match encode_checked(
            &msg,
            correlation,
            self.node,
            self.epoch,
            role,
            st.link.frame_len_max_bytes,
        ) {
            Ok(f) => Bytes::from(f),
            Err(reason) => {
                // A node that builds a frame it may not send, or one over
                // the cap, has a bug the simulation must report.
                st.refuse(format!(
                    "node {} sending {:?}: {reason}",
                    self.node,
                    msg.kind()
                ));
                return Err(SendError::new(to, reason, msg));
            }
        };
        drop(msg);
        let link = (self.node, to);
        let cfg = st.link.clone();
        let copies = if st.rng.chance(cfg.duplicate) {
            st.faults.duplicated += 1;
            2
        } else {
            1
        };
        let now = Instant::now();
        st.faults.messages += copies;
        for _ in 0..copies {
            let lat = cfg.latency_us + st.jitter(link, now);
            let mut at = now + Duration::from_micros(lat);
            if let Some(&l) = st.last_arrival.get(&link)
                && l > at
            {
                at = l;
            }
            if st.rng.chance(cfg.loss) {
                // Resent after a probe timeout (25 ms ack delay + 3 RTTs);
                // what follows on the link waits behind it.
                st.faults.lost += 1;
                at += Duration::from_micros(25_000 + 6 * cfg.latency_us);
            }
            let reordered = st.rng.chance(cfg.reorder);
            if reordered {
                // Held back outside the link's order: what is sent next
                // on this link overtakes it.
                st.faults.reordered += 1;
                let extra = st.rng.range(1, 10) * cfg.latency_us.max(1) + cfg.jitter_us;
                at += Duration::from_micros(extra);
            } else {
                st.last_arrival.insert(link, at);
            }
            st.faults.frame_bytes += frame.len() as u64;
            let wire = Wire::Frame {
                from: self.node,
                frame: frame.clone(),
            };
            let cut = st.cut.contains(&link);
            if cut || st.clogged.contains(&link) {
                if cut {
                    st.faults.partitioned += 1;
                } else {
                    st.faults.clogged += 1;
                }
                let net = self.net.clone();
                let idle = Duration::from_millis(cfg.idle_timeout_ms);
                tokio::spawn(async move {
                    loop {
                        {
                            let mut st = net.lock();
                            if !st.cut.contains(&link) && !st.clogged.contains(&link) {
                                break;
                            }
                            if Instant::now().saturating_duration_since(now) > idle {
                                // The connection timed out: what it held is gone.
                                st.faults.dropped += 1;
                                return;
                            }
                        }
                        tokio::time::sleep(CLOG_POLL).await;
                    }
                    net.deliver_at(to, to_epoch, Instant::now().max(at), wire);
                });
            } else if reordered {
                self.net.deliver_at(to, to_epoch, at, wire);
            } else {
                self.net.enqueue(&mut st, link, (at, to_epoch, wire));
            }
        }
        Ok(())
    }

    fn send_bulk(
        &self,
        to: NodeId,
        header: KvTransferHeader,
        data: Bytes,
    ) -> BoxFuture<Result<(), BulkError>> {
        let net = self.net.clone();
        let (from, alive, frame) = {
            let mut st = net.lock();
            let role = st.roles[self.node as usize];
            let header = Message::KvBlocks(header.clone());
            let cap = st.link.frame_len_max_bytes;
            let frame = encode_checked(&header, 0, self.node, self.epoch, role, cap);
            if let Err(e) = &frame {
                st.refuse(format!("node {} sending a KV transfer: {e}", self.node));
            }
            (self.node, self.alive(&st), frame)
        };
        Box::pin(async move {
            if !alive {
                return Err(BulkError::Send(SendFailure::Closed));
            }
            let frame = Bytes::from(frame.map_err(BulkError::Send)?);
            let start = {
                let mut st = net.lock();
                match live_peer(true, &st.nodes, to).map(|slot| slot.epoch) {
                    Err(e) => Err((st.hang_until(to), e)),
                    Ok(_) if st.cut.contains(&(from, to)) => {
                        st.faults.partitioned += 1;
                        Err((None, SendFailure::PeerGone))
                    }
                    Ok(to_epoch) => {
                        let cfg = st.link.clone();
                        let lat = cfg.latency_us + st.jitter((from, to), Instant::now());
                        let bytes = (u64::from(header.token_count) * cfg.kv_bytes_per_token)
                            .max(data.len() as u64);
                        st.faults.transfers += 1;
                        st.faults.transfer_bytes += bytes;
                        Ok((to_epoch, bytes as f64 / cfg.bandwidth, lat))
                    }
                }
            };
            let (to_epoch, secs, lat) = match start {
                Ok(s) => s,
                Err((hang, why)) => return Err(fail_after(hang, why).await),
            };
            tokio::time::sleep(Duration::from_secs_f64(secs) + Duration::from_micros(lat)).await;
            let end = {
                let mut st = net.lock();
                match &st.nodes[to as usize] {
                    Some(slot) if slot.epoch == to_epoch => {
                        st.deliver(to, to_epoch, Wire::Bulk { from, frame, data });
                        Ok(())
                    }
                    _ => Err(st.hang_until(to)),
                }
            };
            match end {
                Ok(()) => Ok(()),
                Err(hang) => Err(fail_after(hang, SendFailure::PeerGone).await),
            }
        })
    }

    fn stats(&self) -> TransportStats {
        TransportStats::default()
    }

    /// A forgotten joined node's connections close: its next message
    /// announces it again, as its redial would.
    fn forget(&self, node: NodeId) {
        let me = self.node;
        self.net
            .lock()
            .announced
            .retain(|&(to, _, from, _)| !(to == me && from == node));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_proto::wire::Submit;
    use flotilla_proto::{EngineRequest, SamplingParams, TenantId};

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap()
    }

    #[test]
    fn frames_cross_encoded_and_wire_bugs_are_refused_and_counted() {
        rt().block_on(async {
            let link = LinkConfig {
                frame_len_max_bytes: 4096,
                ..LinkConfig::default()
            };
            let net = SimNet::new(vec![Role::Router, Role::Worker], link, Rng::new(1));
            let (router_sink, _rrx) = Sink::channel();
            let router = net.join(0, 7, router_sink);
            let (worker_sink, mut wrx) = Sink::channel();
            let worker = net.join(1, 9, worker_sink);
            let submit = Message::Submit(Submit {
                req: 5,
                attempt: 1,
                prefill: None,
                kv_move: false,
                request: EngineRequest {
                    tenant: TenantId(0),
                    prompt: vec![1, 2, 3],
                    max_tokens: 4,
                    sampling: SamplingParams::greedy(),
                    logit_bias: Vec::new(),
                    generated: 0,
                    constraint: None,
                    ignore_eos: false,
                    stop_token_ids: vec![],
                    speculative: true,
                    trace: None,
                },
            });
            router.send(1, 5, submit.clone()).unwrap();
            match wrx.recv().await.unwrap() {
                Inbound::Message {
                    from,
                    epoch,
                    correlation,
                    msg,
                } => assert_eq!((from, epoch, correlation, msg), (0, 7, 5, submit)),
                other => panic!("{other:?}"),
            }
            let f = net.faults();
            assert_eq!(f.frames_refused, 0);
            assert!(
                f.frame_bytes > 32,
                "the envelope and payload were not counted"
            );
            // A worker may not cancel: refused as QUIC refuses it, and counted.
            let cancel = Message::Cancel {
                req: 5,
                stop_string: false,
                attempt: 0,
            };
            let e = worker.send(0, 5, cancel).unwrap_err();
            assert_eq!(e.reason, SendFailure::Forbidden(Role::Worker));
            // Over the frame cap.
            let big = Message::Ping {
                seq: 1,
                pad: vec![0; 8192],
            };
            let e = router.send(1, 1, big).unwrap_err();
            assert!(matches!(e.reason, SendFailure::Encode(_)), "{e}");
            assert_eq!(net.faults().frames_refused, 2);
            assert!(net.refused_frame().unwrap().contains("Ping"));
        });
    }
}
