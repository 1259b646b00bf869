//! How nodes talk: one small [`Transport`] trait, implemented over QUIC
//! ([`quic::QuicTransport`], quinn with mutual TLS under a cluster CA) and,
//! for the deterministic simulation, over a simulated network.
//!
//! The simulated network ([`sim::SimNet`]) is the in-process transport of
//! the simulator and of every cluster test: modelled latency and bandwidth
//! on the (paused) tokio clock, the faults a scenario enables, and the same
//! frame encoder, cap and checks as QUIC.
//!
//! A transport moves [`Message`]s between node ids (indexes in the cluster
//! config). Control messages to one peer travel in order on one stream; a
//! bulk transfer (KV blocks) gets a stream of its own so that it never sits
//! in front of them. Everything a peer sends is checked before anyone sees
//! it: envelope and payload ([`flotilla_proto::wire`]), the sender's
//! certificate against the node it claims to be, the sender's role against
//! the message kind, and the sender's epoch (a message from a node's
//! previous life is dropped).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use flotilla_proto::Role;
use flotilla_proto::wire::{KvTransferHeader, Message};
use tokio::sync::mpsc;

pub mod frames;
pub mod members;
pub mod quic;
pub mod sim;
pub mod stage;
pub mod tls;

/// A boxed future, so `dyn Transport` works.
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

pub use flotilla_proto::NodeId;

/// What the transport hands the node: messages and transfers from peers.
#[derive(Debug)]
pub enum Inbound {
    /// One control message.
    Message {
        /// Sender.
        from: NodeId,
        /// Sender's epoch.
        epoch: u64,
        /// Correlation id from the envelope.
        correlation: u64,
        /// The message.
        msg: Message,
    },
    /// One whole bulk transfer.
    Bulk {
        /// Sender.
        from: NodeId,
        /// Sender's epoch.
        epoch: u64,
        /// What the bytes are.
        header: KvTransferHeader,
        /// The bytes (`header.bytes` of them), in order, in the pieces they
        /// arrived in.
        data: Vec<Bytes>,
    },
    /// A node that is not in the config connected to this one (its
    /// certificate chains to the cluster CA, its role may join, it is not
    /// revoked): from now on it is a peer like the config's, and what it
    /// sends follows this. Said again on each new connection it makes (a
    /// restart, a new address).
    Joined(flotilla_proto::wire::JoinedPeer),
    /// The transport closed (it was shut down, or in a simulation this
    /// node crashed or restarted): nothing more arrives through it.
    Closed,
    /// A control message this node's `send` accepted that never left: the
    /// link could not reach the peer (its dial failed, or its connection
    /// was lost) and dropped what was queued for it. The node learns of it
    /// as it learns of a send refused at once, instead of waiting for an
    /// answer that cannot come.
    Undelivered {
        /// The intended peer.
        to: NodeId,
        /// The message.
        msg: Message,
        /// Why.
        reason: SendFailure,
    },
}

/// Where a transport hands what arrives, from its own tasks, in arrival
/// order per peer: the node's actor mailbox, with no task between them.
/// `deliver` returns false once nobody listens (the actor stopped); the
/// transport then drops what comes for it.
#[derive(Clone)]
pub struct Sink(Arc<dyn Fn(Inbound) -> bool + Send + Sync>);

impl Sink {
    /// A sink that calls `f` for each arrival.
    pub fn new(f: impl Fn(Inbound) -> bool + Send + Sync + 'static) -> Sink {
        Sink(Arc::new(f))
    }

    /// Hands `m` on; false if nobody listens any more.
    pub fn deliver(&self, m: Inbound) -> bool {
        (self.0)(m)
    }

    /// A sink into a channel, and the channel's receiver: for tools and
    /// tests that read what arrives themselves.
    pub fn channel() -> (Sink, mpsc::UnboundedReceiver<Inbound>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Sink::new(move |m| tx.send(m).is_ok()), rx)
    }
}

impl std::fmt::Debug for Sink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sink")
    }
}

/// Why a control message was not queued; the message comes back so the
/// caller can send it elsewhere without a clone.
#[derive(Debug, thiserror::Error)]
#[error("cannot send {:?} to node {to}: {reason}", msg.kind())]
pub struct SendError {
    /// The intended peer.
    pub to: NodeId,
    /// Why.
    pub reason: SendFailure,
    /// The message, handed back (boxed: the error path is rare and the
    /// message is large).
    pub msg: Box<Message>,
}

impl SendError {
    /// The error handing `msg` back.
    pub fn new(to: NodeId, reason: SendFailure, msg: Message) -> SendError {
        SendError {
            to,
            reason,
            msg: Box::new(msg),
        }
    }
}

/// The checks an in-process transport (tests, the simulator) makes before
/// it delivers to slot `to` of `nodes`: the sender's own life is over
/// (`Closed`), `to` names no node (`UnknownPeer`), or that node is down
/// (`PeerGone`). Returns the live peer's slot.
pub fn live_peer<T>(
    sender_alive: bool,
    nodes: &[Option<T>],
    to: NodeId,
) -> Result<&T, SendFailure> {
    if !sender_alive {
        return Err(SendFailure::Closed);
    }
    match nodes.get(to as usize) {
        None => Err(SendFailure::UnknownPeer),
        Some(None) => Err(SendFailure::PeerGone),
        Some(Some(peer)) => Ok(peer),
    }
}

/// The reason in a [`SendError`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SendFailure {
    /// No such node in the config (or it is this node).
    #[error("no such peer")]
    UnknownPeer,
    /// The peer cannot be reached (its last connection failed); the link
    /// keeps retrying with backoff.
    #[error("peer is unreachable")]
    PeerGone,
    /// The per-peer send queue is full.
    #[error("send queue full ({0} messages)")]
    QueueFull(usize),
    /// The message does not fit in one frame.
    #[error("{0}")]
    Encode(String),
    /// This node's role may not send this kind.
    #[error("role {0} may not send this kind")]
    Forbidden(Role),
    /// The transport is shut down.
    #[error("transport closed")]
    Closed,
}

/// Why a bulk transfer failed.
#[derive(Debug, thiserror::Error)]
pub enum BulkError {
    /// See [`SendFailure`].
    #[error("{0}")]
    Send(SendFailure),
    /// The connection or stream failed mid-transfer.
    #[error("transfer failed: {0}")]
    Io(String),
}

/// Moves messages between nodes. Small enough that the simulated network
/// implements it too.
pub trait Transport: Send + Sync + 'static {
    /// This node's id.
    fn node(&self) -> NodeId;
    /// This node's epoch (new on every start).
    fn epoch(&self) -> u64;
    /// Queues one control message; never waits. Messages to one peer arrive
    /// in the order sent, or not at all if the peer goes away.
    fn send(&self, to: NodeId, correlation: u64, msg: Message) -> Result<(), SendError>;
    /// Sends a bulk transfer on a stream of its own; resolves once the peer
    /// has read all of it.
    fn send_bulk(
        &self,
        to: NodeId,
        header: KvTransferHeader,
        data: Bytes,
    ) -> BoxFuture<Result<(), BulkError>>;
    /// Counters of what was refused or dropped.
    fn stats(&self) -> TransportStats;
    /// Whether a message sent to `to` now has a way there: false while
    /// the link to it is down and waiting to redial.
    fn is_reachable(&self, to: NodeId) -> bool {
        let _ = to;
        true
    }
    /// `to` restarted (a message came from a newer epoch): our connection
    /// to it reaches its old life, where frames vanish until the idle
    /// timeout says so. Drop it and dial again now; until the new one is
    /// up, `is_reachable(to)` is false.
    fn reconnect(&self, to: NodeId) {
        let _ = to;
    }
    /// Where a node that joined at run time is reached, as a Router saw
    /// it: messages to `peer.node` go there from now on (a node it never
    /// dialed itself is unknown to this one otherwise).
    fn learn(&self, peer: &flotilla_proto::wire::JoinedPeer) {
        let _ = peer;
    }
    /// A joined node is gone for good: drop its link and what it queued.
    fn forget(&self, node: NodeId) {
        let _ = node;
    }
}

/// What a transport refused or dropped, since start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransportStats {
    /// Frames that failed envelope or payload validation.
    pub frames_invalid: u64,
    /// Frames whose kind the sender's role may not send.
    pub frames_forbidden: u64,
    /// Frames from an older epoch of their sender.
    pub frames_stale_epoch: u64,
    /// Connections refused: unknown node, role not the configured one.
    pub connections_refused: u64,
    /// Connections established (outbound).
    pub connects: u64,
    /// Queued control messages handed back as undelivered.
    pub undelivered: u64,
}

/// Counters shared by a transport's tasks.
#[derive(Default)]
pub(crate) struct Counters {
    pub frames_invalid: AtomicU64,
    pub frames_forbidden: AtomicU64,
    pub frames_stale_epoch: AtomicU64,
    pub connections_refused: AtomicU64,
    pub connects: AtomicU64,
    pub undelivered: AtomicU64,
}

impl Counters {
    pub(crate) fn snapshot(&self) -> TransportStats {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        TransportStats {
            frames_invalid: l(&self.frames_invalid),
            frames_forbidden: l(&self.frames_forbidden),
            frames_stale_epoch: l(&self.frames_stale_epoch),
            connections_refused: l(&self.connections_refused),
            connects: l(&self.connects),
            undelivered: l(&self.undelivered),
        }
    }
}

/// The newest epoch seen from each peer. A node that restarts picks a
/// larger epoch; anything still arriving from its old life is dropped.
pub struct EpochFilter {
    newest: Mutex<std::collections::BTreeMap<NodeId, u64>>,
}

impl EpochFilter {
    /// A filter for the config's `nodes` peers (ids `0..nodes`).
    pub fn new(nodes: usize) -> EpochFilter {
        EpochFilter {
            newest: Mutex::new((0..nodes as NodeId).map(|n| (n, 0)).collect()),
        }
    }

    /// Whether a message from `from` at `epoch` is current (and records it).
    pub fn admit(&self, from: NodeId, epoch: u64) -> bool {
        let mut v = self.newest.lock().expect("epoch filter poisoned");
        match v.get_mut(&from) {
            Some(e) if epoch >= *e => {
                *e = epoch;
                true
            }
            _ => false,
        }
    }

    /// A node that joined at run time: its messages are admitted from now
    /// on (a node known already keeps its newest epoch).
    pub fn add(&self, node: NodeId) {
        let mut v = self.newest.lock().expect("epoch filter poisoned");
        v.entry(node).or_insert(0);
    }

    /// A joined node forgotten: nothing of it is admitted any more.
    pub fn remove(&self, node: NodeId) {
        self.newest
            .lock()
            .expect("epoch filter poisoned")
            .remove(&node);
    }
}

/// A fresh epoch for a starting node: wall-clock microseconds, so a restart
/// always gets a larger one than the run before (unless the clock steps
/// back by more than the restart takes).
pub fn new_epoch() -> u64 {
    #[allow(clippy::disallowed_methods)] // the one wall-clock read, at start-up
    let now = std::time::SystemTime::now();
    now.duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(1)
        .max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_live_peer_is_a_live_sender_s_known_and_present_node() {
        let nodes = [Some('a'), None, Some('c')];
        assert_eq!(live_peer(true, &nodes, 0), Ok(&'a'));
        assert_eq!(live_peer(true, &nodes, 1), Err(SendFailure::PeerGone));
        assert_eq!(live_peer(true, &nodes, 3), Err(SendFailure::UnknownPeer));
        // A dead sender reaches nobody, known or not.
        assert_eq!(live_peer(false, &nodes, 0), Err(SendFailure::Closed));
        assert_eq!(live_peer(false, &nodes, 9), Err(SendFailure::Closed));
    }

    #[test]
    fn epoch_filter_drops_the_old_life() {
        let f = EpochFilter::new(2);
        assert!(f.admit(1, 10));
        assert!(f.admit(1, 10));
        assert!(f.admit(1, 12));
        assert!(!f.admit(1, 10), "old epoch after a restart must drop");
        assert!(f.admit(0, 1));
        assert!(!f.admit(5, 1), "unknown node");
    }
}
