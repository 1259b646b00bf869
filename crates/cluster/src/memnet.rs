//! An in-process network for tests: every node's inbox is a channel, a
//! node can be killed (its inbox closes and its own sends fail) and
//! rejoin with a new epoch. Bulk transfers arrive whole. No latency, loss or reordering: those belong
//! to the simulator's network.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use flotilla_proto::wire::{KvTransferHeader, Message};
use flotilla_transport::{
    BoxFuture, BulkError, Inbound, NodeId, SendError, SendFailure, Transport, TransportStats,
    live_peer,
};
use tokio::sync::mpsc;

/// A joined node: its epoch and its inbox.
type Slot = Option<(u64, mpsc::Sender<Inbound>)>;

/// The network: one slot per node.
#[derive(Default)]
pub struct MemNet {
    nodes: Mutex<Vec<Slot>>,
}

/// One node's end of a [`MemNet`].
pub struct MemTransport {
    net: Arc<MemNet>,
    node: NodeId,
    epoch: u64,
}

impl MemNet {
    /// A network of `n` nodes, none joined yet.
    pub fn new(n: usize) -> Arc<MemNet> {
        Arc::new(MemNet {
            nodes: Mutex::new(vec![None; n]),
        })
    }

    /// Node `node` (re)joins at `epoch`.
    pub fn join(
        self: &Arc<MemNet>,
        node: NodeId,
        epoch: u64,
    ) -> (Arc<MemTransport>, mpsc::Receiver<Inbound>) {
        let (tx, rx) = mpsc::channel(4096);
        self.nodes.lock().expect("memnet poisoned")[node as usize] = Some((epoch, tx));
        (
            Arc::new(MemTransport {
                net: self.clone(),
                node,
                epoch,
            }),
            rx,
        )
    }

    /// Node `node` dies: nothing reaches it and nothing it sends arrives.
    pub fn kill(&self, node: NodeId) {
        self.nodes.lock().expect("memnet poisoned")[node as usize] = None;
    }
}

impl MemTransport {
    /// A killed node (or an old life of a rejoined one) is mute.
    fn me_alive(&self, nodes: &[Slot]) -> bool {
        nodes
            .get(self.node as usize)
            .and_then(|s| s.as_ref())
            .is_some_and(|(e, _)| *e == self.epoch)
    }
}

impl Transport for MemTransport {
    fn node(&self) -> NodeId {
        self.node
    }

    fn epoch(&self) -> u64 {
        self.epoch
    }

    fn send(&self, to: NodeId, correlation: u64, msg: Message) -> Result<(), SendError> {
        let nodes = self.net.nodes.lock().expect("memnet poisoned");
        let tx = match live_peer(self.me_alive(&nodes), &nodes, to) {
            Ok((_, tx)) => tx,
            Err(reason) => return Err(SendError::new(to, reason, msg)),
        };
        let inbound = Inbound::Message {
            from: self.node,
            epoch: self.epoch,
            correlation,
            msg,
        };
        tx.try_send(inbound).map_err(|e| {
            let msg = match e.into_inner() {
                Inbound::Message { msg, .. } => msg,
                Inbound::Bulk { .. } | Inbound::Undelivered { .. } => {
                    unreachable!("sent a message")
                }
            };
            SendError::new(to, SendFailure::QueueFull(4096), msg)
        })
    }

    fn send_bulk(
        &self,
        to: NodeId,
        header: KvTransferHeader,
        data: Bytes,
    ) -> BoxFuture<Result<(), BulkError>> {
        let target = {
            let nodes = self.net.nodes.lock().expect("memnet poisoned");
            live_peer(self.me_alive(&nodes), &nodes, to).map(|(_, tx)| tx.clone())
        };
        let (from, epoch) = (self.node, self.epoch);
        Box::pin(async move {
            let tx = target.map_err(BulkError::Send)?;
            tx.send(Inbound::Bulk {
                from,
                epoch,
                header,
                data: vec![data],
            })
            .await
            .map_err(|_| BulkError::Send(SendFailure::PeerGone))
        })
    }

    fn stats(&self) -> TransportStats {
        TransportStats::default()
    }
}
