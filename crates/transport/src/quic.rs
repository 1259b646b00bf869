//! The QUIC transport: quinn endpoints with mutual TLS under the cluster CA.
//!
//! Each node dials every peer it sends to and uses that connection only
//! for its own sends; what a peer sends arrives on the peer's connection.
//! Two one-way connections per pair need no tie-breaking when both dial at
//! once, and a restarted node simply dials again.
//!
//! On a connection, control messages travel in order on one long-lived uni
//! stream. Bulk transfers (KV blocks) travel apart from them: each node has
//! a second endpoint, on a UDP socket and a thread of its own, that only
//! carries bulk connections, each transfer on a uni stream of its own. A
//! control frame therefore never waits behind bulk datagrams: not in a
//! socket buffer, not in quinn's packet queue, not behind a turn of the
//! thread that encrypts and sends them. A node learns a peer's bulk port
//! when it dials the peer: the peer's first act on an accepted control
//! connection is to send it (the `hello`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use flotilla_proto::Role;
use flotilla_proto::wire::{
    self, HEADER_LEN, Header, KvTransferHeader, Message, decode_payload, encode_frame,
};
use quinn::{Connection, Endpoint, RecvStream, VarInt};
use tokio::sync::mpsc;

use crate::frames::encode_checked;
use crate::members::{self, JoinPolicy, Refusal, Revocations};
use crate::tls::{self, TlsMaterial};
use crate::{
    BoxFuture, BulkError, Counters, EpochFilter, Inbound, NodeId, SendError, SendFailure, Sink,
    Transport, TransportStats,
};
use flotilla_proto::wire::JoinedPeer;

/// Close codes a node sends when it refuses a peer.
mod close {
    pub const SHUTDOWN: u32 = 0;
    pub const FORBIDDEN: u32 = 1;
    pub const UNKNOWN_NODE: u32 = 2;
    pub const PROTOCOL: u32 = 3;
}

/// Bulk data is written in slices of this size: quinn copies a larger
/// `write` into a fresh allocation, and smaller slices bound how much bulk
/// data can sit in front of a control frame in the send buffer.
const BULK_CHUNK_BYTES: usize = 256 * 1024;

/// Upper bound of MTU discovery on connections that send one datagram per
/// system call (control connections, and bulk connections on paths that
/// carry datagrams this large: loopback).
const MTU_MAX_BYTES: u16 = 65000;

/// Upper bound of MTU discovery on bulk connections that batch datagrams
/// with segmentation offload: quinn sends up to 10 per call, and the
/// kernel refuses a batch over 64 KiB (quinn then takes the MTU for a black
/// hole and falls back to 1200).
const MTU_GSO_MAX_BYTES: u16 = 6500;

/// A path whose control connection discovered an MTU at least this large
/// (loopback's is 64 KiB) gets bulk connections of single large datagrams:
/// a 64 KiB datagram costs quinn one packet's work where segmentation
/// offload would cost it ten. Ethernet paths (1500, or 9000 with jumbo
/// frames) keep offload.
const LARGE_DATAGRAM_MTU_MIN: u16 = 16 * 1024;

/// Receive buffers for bulk transfers kept for reuse: a transfer is copied
/// out of quinn's per-datagram buffers into one of these, so neither
/// quinn's buffers nor a fresh multi-megabyte one have to be faulted in
/// (page faults took a quarter of the receiving thread's time).
const RECV_BUFFERS_KEPT: usize = 4;

/// Room reserved for a bulk transfer before its bytes arrive: the header's
/// length comes from the peer, so the buffer grows with the data beyond
/// this (flow control bounds it) rather than trusting the header.
const RECV_RESERVE_MAX: usize = 8 << 20;

/// A buffer larger than this is freed, not kept, when its transfer ends.
const RECV_BUFFER_KEPT_MAX: usize = 256 << 20;

/// UDP socket buffer size asked for (see `size_socket_buffers`).
const SOCKET_BUFFER_BYTES: usize = 8 << 20;

/// The hello an accepting node sends on a new control connection: these
/// four bytes, its protocol version and its bulk endpoint's port (both
/// big-endian `u16`).
const HELLO_MAGIC: [u8; 4] = *b"FLHI";

/// A peer as the transport knows it.
#[derive(Clone, Debug)]
pub struct PeerSpec {
    /// Node name, also the name in its certificate.
    pub name: String,
    /// Its role, which its certificate must carry too.
    pub role: Role,
    /// `host:port` to dial; empty for a node never dialed.
    pub addr: String,
}

/// Fault hooks for tests and benchmarks on one machine: this kernel has no
/// netem, so delay is injected where frames leave the node.
#[derive(Clone, Copy, Debug, Default)]
pub struct LinkFaults {
    /// Added before each control frame is written.
    pub delay: Duration,
    /// One frame in this many is delayed three times more (a lost packet's
    /// retransmission); 0 = never.
    pub loss_one_in: u32,
}

/// Everything the QUIC transport needs; the binary builds it from the
/// validated config (`flotilla/src/node.rs`, `quic_options`).
#[derive(Clone, Debug)]
pub struct QuicOptions {
    /// This node's id: its index into `nodes`, or, for a node that joins
    /// at run time, `joined_node_id` of its name.
    pub node: NodeId,
    /// Every node of the config file (index = id), this one included
    /// unless it joins at run time.
    pub nodes: Vec<PeerSpec>,
    /// This node, when it joins at run time (is not in `nodes`).
    pub joining: Option<PeerSpec>,
    /// Who else may connect: nodes not in the config, and the revocation
    /// list.
    pub join: JoinPolicy,
    /// Socket address to bind.
    pub listen: SocketAddr,
    /// UDP port of the bulk endpoint, on `listen`'s address; 0 = any free
    /// port (peers learn it in the hello).
    pub bulk_port: u16,
    /// This node's epoch.
    pub epoch: u64,
    /// Cap on one control frame's payload, bytes.
    pub frame_len_max_bytes: u32,
    /// Control frames waiting per peer.
    pub send_queue_len_max: usize,
    /// Cap on one bulk transfer, bytes.
    pub bulk_len_max_bytes: u64,
    /// QUIC keep-alive interval.
    pub keep_alive: Duration,
    /// A connection silent this long is closed.
    pub idle_timeout: Duration,
    /// A dial that has no answer after this long fails (QUIC learns nothing
    /// from a closed UDP port, so this is how a dead peer is noticed).
    pub connect_timeout: Duration,
    /// Longest wait between reconnect attempts.
    pub reconnect_backoff_max: Duration,
    /// Injected faults on this node's outgoing links (tests, benchmarks).
    pub faults: LinkFaults,
}

/// Why the transport did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// Certificates.
    #[error("{0}")]
    Tls(#[from] tls::TlsError),
    /// The node's certificate does not match its config entry.
    #[error("certificate is for {cert_name} ({cert_role}), config says node {name} ({role})")]
    Identity {
        /// Name in the certificate.
        cert_name: String,
        /// Role in the certificate.
        cert_role: Role,
        /// Name in the config.
        name: String,
        /// Role in the config.
        role: Role,
    },
    /// Bad option.
    #[error("{0}")]
    Options(String),
    /// Binding the UDP socket.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// Address.
        addr: SocketAddr,
        /// Error.
        source: std::io::Error,
    },
}

const CONNECTING: u8 = 0;
const UP: u8 = 1;
const DOWN: u8 = 2;

#[derive(Clone)]
struct Link {
    tx: mpsc::Sender<Vec<u8>>,
    state: Arc<LinkState>,
}

/// The links to every peer: the config's by index, and those of nodes
/// that joined at run time, by id.
struct Peers {
    fixed: Vec<Option<Link>>,
    joined: RwLock<BTreeMap<NodeId, Link>>,
}

impl Peers {
    fn get(&self, to: NodeId) -> Option<Link> {
        if flotilla_proto::is_joined_id(to) {
            return self
                .joined
                .read()
                .expect("peers poisoned")
                .get(&to)
                .cloned();
        }
        self.fixed.get(to as usize).and_then(|l| l.clone())
    }

    /// The names of the joined nodes, by id.
    fn joined_names(&self) -> BTreeMap<NodeId, String> {
        self.joined
            .read()
            .expect("peers poisoned")
            .iter()
            .map(|(&n, l)| (n, l.state.peer.name.clone()))
            .collect()
    }

    /// Every link's state.
    fn states(&self) -> Vec<Arc<LinkState>> {
        let mut v: Vec<_> = self
            .fixed
            .iter()
            .flatten()
            .map(|l| l.state.clone())
            .collect();
        v.extend(
            self.joined
                .read()
                .expect("peers poisoned")
                .values()
                .map(|l| l.state.clone()),
        );
        v
    }
}

/// What a new link's task needs.
struct LinkCtx {
    endpoint: Endpoint,
    opts: Arc<QuicOptions>,
    counters: Arc<Counters>,
    closed: Arc<AtomicBool>,
    sink: Sink,
    revoked: Arc<Revocations>,
}

impl LinkCtx {
    /// A link to `peer` (id `to`), its task dialing at once.
    fn spawn(&self, to: NodeId, peer: PeerSpec) -> Link {
        let (tx, rx) = mpsc::channel(self.opts.send_queue_len_max);
        let state = Arc::new(LinkState {
            phase: AtomicU8::new(CONNECTING),
            conn: Mutex::new(None),
            bulk: tokio::sync::Mutex::new(None),
            bulk_addr: Mutex::new(None),
            peer,
            wake: tokio::sync::Notify::new(),
            reset: tokio::sync::Notify::new(),
        });
        tokio::spawn(run_link(
            self.endpoint.clone(),
            to,
            rx,
            state.clone(),
            self.opts.clone(),
            self.counters.clone(),
            self.closed.clone(),
            self.sink.clone(),
            self.revoked.clone(),
        ));
        Link { tx, state }
    }
}

/// Adds (or, at a new address, replaces) the link to a joined node; true
/// if the link is new.
fn add_joined(peers: &Peers, ctx: &LinkCtx, epochs: &EpochFilter, peer: &JoinedPeer) -> bool {
    let mut joined = peers.joined.write().expect("peers poisoned");
    if let Some(l) = joined.get(&peer.node)
        && l.state.peer.addr == peer.addr
        && l.state.peer.name == peer.name
    {
        return false;
    }
    let spec = PeerSpec {
        name: peer.name.clone(),
        role: peer.role,
        addr: peer.addr.clone(),
    };
    if let Some(old) = joined.insert(peer.node, ctx.spawn(peer.node, spec)) {
        // Its task ends with its last sender; its connection goes now.
        if let Some(c) = old.state.conn.lock().expect("link state poisoned").take() {
            c.close(VarInt::from_u32(close::SHUTDOWN), b"peer moved");
        }
    }
    epochs.add(peer.node);
    true
}

struct LinkState {
    phase: AtomicU8,
    conn: Mutex<Option<Connection>>,
    /// The connection for bulk transfers, from this node's bulk endpoint to
    /// the peer's, dialed on first use; it lives on the bulk thread.
    bulk: tokio::sync::Mutex<Option<Connection>>,
    /// The peer's bulk endpoint, from the hello on the current control
    /// connection.
    bulk_addr: Mutex<Option<SocketAddr>>,
    peer: PeerSpec,
    /// Rung when the peer connects to us: it is back, so the dialer skips
    /// the rest of its backoff.
    wake: tokio::sync::Notify,
    /// Rung when the peer restarted: the connection in use reaches its old
    /// life and is dropped for a new one.
    reset: tokio::sync::Notify,
}

/// Bulk receive buffers kept for reuse, so a steady stream of transfers
/// neither grows the heap nor faults pages in.
#[derive(Default)]
struct RecvBuffers {
    free: Mutex<Vec<Vec<u8>>>,
}

impl RecvBuffers {
    /// An empty buffer with room for `len` bytes: the smallest kept one that
    /// fits, else the largest grown, else a new one.
    fn take(&self, len: usize) -> Vec<u8> {
        let mut free = self.free.lock().expect("buffer pool poisoned");
        let pick = free
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= len)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i)
            .or_else(|| (0..free.len()).max_by_key(|&i| free[i].capacity()));
        let mut buf = pick.map(|i| free.swap_remove(i)).unwrap_or_default();
        drop(free);
        buf.clear();
        buf.reserve_exact(len.min(RECV_RESERVE_MAX));
        buf
    }

    fn give(&self, buf: Vec<u8>) {
        if buf.capacity() > RECV_BUFFER_KEPT_MAX {
            return;
        }
        let mut free = self.free.lock().expect("buffer pool poisoned");
        if free.len() < RECV_BUFFERS_KEPT {
            free.push(buf);
        } else if let Some(small) = free.iter_mut().min_by_key(|b| b.capacity())
            && small.capacity() < buf.capacity()
        {
            *small = buf;
        }
    }
}

/// A received transfer's bytes; the buffer goes back to its pool when the
/// last `Bytes` of it is dropped.
struct PooledBuf {
    buf: Vec<u8>,
    pool: Arc<RecvBuffers>,
}

impl AsRef<[u8]> for PooledBuf {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        self.pool.give(std::mem::take(&mut self.buf));
    }
}

/// The bulk endpoint and the thread whose runtime drives it and every bulk
/// connection: transfers are spawned there, so their packets are encrypted,
/// sent, received and copied beside, not in front of, control frames.
struct BulkPlane {
    endpoint: Endpoint,
    handle: tokio::runtime::Handle,
    /// Dropped (or sent) to end the thread.
    stop: Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
}

impl BulkPlane {
    /// Starts the thread and binds the endpoint inside its runtime.
    fn start(
        node: NodeId,
        addr: SocketAddr,
        server: quinn::ServerConfig,
    ) -> Result<BulkPlane, StartError> {
        let (handle_tx, handle_rx) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name(format!("quic-bulk-{node}"))
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = handle_tx.send(Err(e));
                        return;
                    }
                };
                let _ = handle_tx.send(Ok(rt.handle().clone()));
                rt.block_on(async move {
                    let _ = stopped.await;
                });
            })
            .map_err(|e| StartError::Options(format!("bulk thread: {e}")))?;
        let handle = handle_rx
            .recv()
            .map_err(|_| StartError::Options("bulk thread ended at start".into()))?
            .map_err(|e| StartError::Options(format!("bulk runtime: {e}")))?;
        let bind = |source| StartError::Bind { addr, source };
        let socket = std::net::UdpSocket::bind(addr).map_err(bind)?;
        size_socket_buffers(&socket);
        // Inside the bulk runtime, so that the endpoint's socket and driver
        // (and the drivers of the connections it accepts) belong to it.
        let _in_bulk = handle.enter();
        let runtime = quinn::default_runtime()
            .ok_or_else(|| StartError::Options("no async runtime for quinn".into()))?;
        let socket = Arc::new(YieldingSocket {
            inner: runtime.wrap_udp_socket(socket).map_err(bind)?,
            moved: Default::default(),
        });
        let endpoint =
            Endpoint::new_with_abstract_socket(endpoint_config()?, Some(server), socket, runtime)
                .map_err(bind)?;
        Ok(BulkPlane {
            endpoint,
            handle,
            stop: Mutex::new(Some(stop)),
        })
    }
}

/// The bulk thread gives its core away (`sched_yield`) each time its socket
/// has moved this many more bytes, in or out.
const BULK_YIELD_BYTES: usize = 256 * 1024;

/// The bulk endpoint's socket: quinn's own, which also offers the core to
/// whatever else waits for it every `BULK_YIELD_BYTES` moved. While a
/// transfer runs, the bulk threads of sender and receiver can fill every
/// core (encryption, system calls, copies); a control frame's thread woken
/// then would otherwise wait for the end of a bulk thread's time slice,
/// milliseconds (measured: round trips under a transfer p99 12-22x idle
/// on 2 vCPUs with the bulk work on threads of its own, 2-4x with these
/// yields, the transfer as fast).
#[derive(Debug)]
struct YieldingSocket {
    inner: Arc<dyn quinn::AsyncUdpSocket>,
    moved: std::sync::atomic::AtomicUsize,
}

impl YieldingSocket {
    fn count(&self, bytes: usize) {
        let before = self.moved.fetch_add(bytes, Ordering::Relaxed);
        if before / BULK_YIELD_BYTES != (before + bytes) / BULK_YIELD_BYTES {
            std::thread::yield_now();
        }
    }
}

impl quinn::AsyncUdpSocket for YieldingSocket {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn quinn::UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, transmit: &quinn::udp::Transmit) -> std::io::Result<()> {
        self.inner.try_send(transmit)?;
        self.count(transmit.contents.len());
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut std::task::Context,
        bufs: &mut [std::io::IoSliceMut<'_>],
        meta: &mut [quinn::udp::RecvMeta],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let r = self.inner.poll_recv(cx, bufs, meta);
        if let std::task::Poll::Ready(Ok(n)) = &r {
            self.count(meta[..*n].iter().map(|m| m.len).sum());
        }
        r
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.inner.max_transmit_segments()
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}

/// Aborts a task when the future waiting for it is dropped: a transfer
/// whose sender gave up stops, as it did when it ran in the caller's task.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The endpoint settings both endpoints use: the UDP payload cap (1472 by
/// default) also caps MTU discovery, so it is raised to the discovery bound.
fn endpoint_config() -> Result<quinn::EndpointConfig, StartError> {
    let mut ec = quinn::EndpointConfig::default();
    ec.max_udp_payload_size(MTU_MAX_BYTES + 28)
        .map_err(|e| StartError::Options(e.to_string()))?;
    Ok(ec)
}

/// A node's QUIC transport.
pub struct QuicTransport {
    node: NodeId,
    epoch: u64,
    role: Role,
    frame_cap: u32,
    peers: Arc<Peers>,
    ctx: Arc<LinkCtx>,
    epochs: Arc<EpochFilter>,
    /// Connections peers dialed to us, on the control and bulk endpoints.
    accepted: [Accepted; 2],
    endpoint: Endpoint,
    bulk: BulkPlane,
    counters: Arc<Counters>,
    closed: Arc<AtomicBool>,
    connect_timeout: Duration,
    /// Client configs for bulk connections: single large datagrams, or
    /// segmentation offload (see `LARGE_DATAGRAM_MTU_MIN`).
    bulk_large: quinn::ClientConfig,
    bulk_gso: quinn::ClientConfig,
    /// Where arrivals go; told [`Inbound::Closed`] on `close`.
    sink: Sink,
}

impl QuicTransport {
    /// Binds the endpoint, starts accepting peers and dialing them. Must be
    /// called inside a tokio runtime. What peers send goes to `sink`, from
    /// the tasks that read it.
    pub fn start(
        opts: QuicOptions,
        certs: &TlsMaterial,
        sink: Sink,
    ) -> Result<Arc<QuicTransport>, StartError> {
        let me = match &opts.joining {
            Some(me) => {
                if opts.node != flotilla_proto::joined_node_id(&me.name) {
                    return Err(StartError::Options(format!(
                        "a joining node's id is its name's ({}), not {}",
                        flotilla_proto::joined_node_id(&me.name),
                        opts.node
                    )));
                }
                me.clone()
            }
            None => opts
                .nodes
                .get(opts.node as usize)
                .ok_or_else(|| StartError::Options(format!("node id {} not in nodes", opts.node)))?
                .clone(),
        };
        let id = certs.identity()?;
        if id.name != me.name || id.role != me.role {
            return Err(StartError::Identity {
                cert_name: id.name,
                cert_role: id.role,
                name: me.name,
                role: me.role,
            });
        }
        if opts.frame_len_max_bytes < wire::FRAME_LEN_MIN_BYTES || opts.send_queue_len_max == 0 {
            return Err(StartError::Options(
                "frame cap below 4096 bytes or an empty send queue".into(),
            ));
        }
        let tc = Arc::new(transport_config(&opts, false)?);
        let server = tls::server_config(certs, tc.clone())?;
        let client = tls::client_config(certs, tc.clone())?;
        let bulk_large = client.clone();
        let bulk_gso = tls::client_config(certs, Arc::new(transport_config(&opts, true)?))?;
        let bind = |source| StartError::Bind {
            addr: opts.listen,
            source,
        };
        let socket = std::net::UdpSocket::bind(opts.listen).map_err(bind)?;
        size_socket_buffers(&socket);
        let runtime = quinn::default_runtime()
            .ok_or_else(|| StartError::Options("no async runtime for quinn".into()))?;
        let mut endpoint = Endpoint::new(endpoint_config()?, Some(server.clone()), socket, runtime)
            .map_err(bind)?;
        endpoint.set_default_client_config(client);
        let bulk = BulkPlane::start(
            opts.node,
            SocketAddr::new(opts.listen.ip(), opts.bulk_port),
            server,
        )?;
        let bulk_port = bulk
            .endpoint
            .local_addr()
            .map_err(|source| StartError::Bind {
                addr: opts.listen,
                source,
            })?
            .port();

        let counters = Arc::new(Counters::default());
        let in_tx = sink;
        let epochs = Arc::new(EpochFilter::new(opts.nodes.len()));
        let opts = Arc::new(opts);
        let closed = Arc::new(AtomicBool::new(false));

        let revoked = Arc::new(Revocations::new(opts.join.revoked.clone()));
        let ctx = Arc::new(LinkCtx {
            endpoint: endpoint.clone(),
            opts: opts.clone(),
            counters: counters.clone(),
            closed: closed.clone(),
            sink: in_tx.clone(),
            revoked: revoked.clone(),
        });
        let mut fixed = Vec::with_capacity(opts.nodes.len());
        for (i, peer) in opts.nodes.iter().enumerate() {
            // An empty address: a node this one never dials (a pipeline
            // group's later stage speaks only to its stage 0).
            if (i as NodeId == opts.node && opts.joining.is_none()) || peer.addr.is_empty() {
                fixed.push(None);
                continue;
            }
            fixed.push(Some(ctx.spawn(i as NodeId, peer.clone())));
        }
        let peers = Arc::new(Peers {
            fixed,
            joined: RwLock::new(BTreeMap::new()),
        });
        let accept = |endpoint: Endpoint, plane| Accept {
            endpoint,
            plane,
            peers: peers.clone(),
            ctx: ctx.clone(),
            conns: Arc::new(Mutex::new(BTreeMap::new())),
            opts: opts.clone(),
            in_tx: in_tx.clone(),
            epochs: epochs.clone(),
            counters: counters.clone(),
            bufs: Arc::new(RecvBuffers::default()),
        };
        let control = accept(endpoint.clone(), Plane::Control { bulk_port });
        let on_bulk = accept(bulk.endpoint.clone(), Plane::Bulk);
        let accepted = [control.conns.clone(), on_bulk.conns.clone()];
        if opts.join.revoked.is_some() {
            tokio::spawn(watch_revocations(
                revoked,
                peers.clone(),
                [control.conns.clone(), on_bulk.conns.clone()],
                opts.keep_alive.max(Duration::from_millis(100)),
                closed.clone(),
            ));
        }
        tokio::spawn(control.run());
        bulk.handle.spawn(on_bulk.run());
        Ok(Arc::new(QuicTransport {
            node: opts.node,
            epoch: opts.epoch,
            role: me.role,
            frame_cap: opts.frame_len_max_bytes,
            peers,
            ctx,
            epochs,
            accepted,
            endpoint,
            bulk,
            counters,
            closed,
            connect_timeout: opts.connect_timeout,
            bulk_large,
            bulk_gso,
            sink: in_tx,
        }))
    }

    /// [`QuicTransport::start`] with its arrivals in a channel, for tools
    /// and tests that read them themselves.
    pub fn start_channel(
        opts: QuicOptions,
        certs: &TlsMaterial,
    ) -> Result<
        (
            Arc<QuicTransport>,
            tokio::sync::mpsc::UnboundedReceiver<Inbound>,
        ),
        StartError,
    > {
        let (sink, rx) = Sink::channel();
        QuicTransport::start(opts, certs, sink).map(|t| (t, rx))
    }

    /// The bound UDP address.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.endpoint.local_addr()
    }

    /// The bulk endpoint's bound UDP address.
    pub fn bulk_addr(&self) -> std::io::Result<SocketAddr> {
        self.bulk.endpoint.local_addr()
    }

    /// Whether the link to `to` has a live connection.
    pub fn is_connected(&self, to: NodeId) -> bool {
        self.link(to)
            .is_some_and(|l| l.state.phase.load(Ordering::Acquire) == UP)
    }

    /// The current path MTUs of the links to `to`: (control, bulk), each
    /// when connected.
    pub fn path_mtu(&self, to: NodeId) -> (Option<u16>, Option<u16>) {
        let Some(l) = self.link(to) else {
            return (None, None);
        };
        let mtu = |c: Option<&Connection>| c.map(|c| c.stats().path.current_mtu);
        let control = mtu(l.state.conn.lock().expect("link state poisoned").as_ref());
        let bulk = l.state.bulk.try_lock().ok().and_then(|b| mtu(b.as_ref()));
        (control, bulk)
    }

    /// Closes every connection; further sends fail.
    pub fn close(&self) {
        if !self.closed.swap(true, Ordering::AcqRel) {
            self.sink.deliver(Inbound::Closed);
        }
        self.endpoint
            .close(VarInt::from_u32(close::SHUTDOWN), b"shutdown");
        self.bulk
            .endpoint
            .close(VarInt::from_u32(close::SHUTDOWN), b"shutdown");
        if let Some(stop) = self.bulk.stop.lock().expect("bulk plane poisoned").take() {
            let _ = stop.send(());
        }
    }

    fn link(&self, to: NodeId) -> Option<Link> {
        self.peers.get(to)
    }

    /// Queues an already-encoded frame, skipping this node's own role check
    /// (tests use it to play a misbehaving peer).
    #[doc(hidden)]
    pub fn send_unchecked(
        &self,
        to: NodeId,
        correlation: u64,
        msg: Message,
    ) -> Result<(), SendError> {
        match encode_frame(&msg, correlation, self.node, self.epoch, self.frame_cap) {
            Ok(frame) => self.queue(to, frame, msg),
            Err(e) => Err(SendError::new(to, SendFailure::Encode(e.to_string()), msg)),
        }
    }

    /// Queues an encoded frame of `msg` on the control stream to `to`.
    fn queue(&self, to: NodeId, frame: Vec<u8>, msg: Message) -> Result<(), SendError> {
        let Some(link) = self.link(to) else {
            return Err(SendError {
                to,
                reason: SendFailure::UnknownPeer,
                msg: Box::new(msg),
            });
        };
        if link.state.phase.load(Ordering::Acquire) == DOWN {
            return Err(SendError {
                to,
                reason: SendFailure::PeerGone,
                msg: Box::new(msg),
            });
        }
        match link.tx.try_send(frame) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(_)) => Err(SendError {
                to,
                reason: SendFailure::QueueFull(link.tx.max_capacity()),
                msg: Box::new(msg),
            }),
            Err(mpsc::error::TrySendError::Closed(_)) => Err(SendError {
                to,
                reason: SendFailure::Closed,
                msg: Box::new(msg),
            }),
        }
    }
}

impl Drop for QuicTransport {
    fn drop(&mut self) {
        self.close();
    }
}

impl Transport for QuicTransport {
    fn node(&self) -> NodeId {
        self.node
    }

    fn epoch(&self) -> u64 {
        self.epoch
    }

    fn send(&self, to: NodeId, correlation: u64, msg: Message) -> Result<(), SendError> {
        let cap = self.frame_cap;
        match encode_checked(&msg, correlation, self.node, self.epoch, self.role, cap) {
            Ok(frame) => self.queue(to, frame, msg),
            Err(reason) => Err(SendError::new(to, reason, msg)),
        }
    }

    fn send_bulk(
        &self,
        to: NodeId,
        header: KvTransferHeader,
        data: Bytes,
    ) -> BoxFuture<Result<(), BulkError>> {
        let link = match self.link(to) {
            None => Err(SendFailure::UnknownPeer),
            Some(l) if l.state.phase.load(Ordering::Acquire) != UP => Err(SendFailure::PeerGone),
            Some(l) => Ok(l.state.clone()),
        };
        let endpoint = self.bulk.endpoint.clone();
        let connect_timeout = self.connect_timeout;
        let (bulk_large, bulk_gso) = (self.bulk_large.clone(), self.bulk_gso.clone());
        let frame = encode_checked(
            &Message::KvBlocks(header.clone()),
            header.req,
            self.node,
            self.epoch,
            self.role,
            self.frame_cap,
        );
        // The transfer runs on the bulk thread; dropping the returned future
        // stops it.
        let task = AbortOnDrop(self.bulk.handle.spawn(async move {
            // The role policy first, as for a control message.
            let frame = frame.map_err(BulkError::Send)?;
            if header.bytes != data.len() as u64 {
                return Err(BulkError::Io(format!(
                    "header says {} bytes, {} given",
                    header.bytes,
                    data.len()
                )));
            }
            let link = link.map_err(BulkError::Send)?;
            let io = |e: &dyn std::fmt::Display| BulkError::Io(e.to_string());
            let conn = {
                let mut bulk = link.bulk.lock().await;
                match bulk.as_ref() {
                    Some(c) if c.close_reason().is_none() => c.clone(),
                    _ => {
                        let (control_mtu, addr) = {
                            let control = link.conn.lock().expect("link state poisoned");
                            let addr = *link.bulk_addr.lock().expect("link state poisoned");
                            (
                                control.as_ref().map_or(0, |c| c.stats().path.current_mtu),
                                addr,
                            )
                        };
                        let addr = addr.ok_or(BulkError::Send(SendFailure::PeerGone))?;
                        let config = if control_mtu >= LARGE_DATAGRAM_MTU_MIN {
                            bulk_large
                        } else {
                            bulk_gso
                        };
                        let c = dial_addr(&endpoint, addr, &link.peer, connect_timeout, config)
                            .await
                            .map_err(BulkError::Io)?;
                        *bulk = Some(c.clone());
                        c
                    }
                }
            };
            let mut s = conn.open_uni().await.map_err(|e| io(&e))?;
            s.write_all(&frame).await.map_err(|e| io(&e))?;
            let mut off = 0;
            while off < data.len() {
                let end = (off + BULK_CHUNK_BYTES).min(data.len());
                s.write_chunk(data.slice(off..end))
                    .await
                    .map_err(|e| io(&e))?;
                off = end;
            }
            s.finish().map_err(|e| io(&e))?;
            // Resolves once the peer has read the stream to its end.
            s.stopped().await.map_err(|e| io(&e))?;
            Ok(())
        }));
        Box::pin(async move {
            let mut task = task;
            match (&mut task.0).await {
                Ok(r) => r,
                Err(e) => Err(BulkError::Io(format!("bulk task: {e}"))),
            }
        })
    }

    fn stats(&self) -> TransportStats {
        self.counters.snapshot()
    }

    fn is_reachable(&self, to: NodeId) -> bool {
        self.link(to)
            .is_some_and(|l| l.state.phase.load(Ordering::Acquire) != DOWN)
    }

    fn learn(&self, peer: &JoinedPeer) {
        if !flotilla_proto::is_joined_id(peer.node)
            || peer.node != flotilla_proto::joined_node_id(&peer.name)
            || peer.node == self.node
        {
            return;
        }
        if add_joined(&self.peers, &self.ctx, &self.epochs, peer) {
            tracing::info!(peer = %peer.name, addr = %peer.addr, "learned a joined node");
        }
    }

    fn forget(&self, node: NodeId) {
        if !flotilla_proto::is_joined_id(node) {
            return;
        }
        let gone = self
            .peers
            .joined
            .write()
            .expect("peers poisoned")
            .remove(&node);
        if let Some(l) = gone {
            if let Some(c) = l.state.conn.lock().expect("link state poisoned").take() {
                c.close(VarInt::from_u32(close::SHUTDOWN), b"forgotten");
            }
            self.epochs.remove(node);
            // Its own connections to us go too: if it is alive after all,
            // it dials again and joins anew.
            for a in &self.accepted {
                let conns: Vec<Connection> = a
                    .lock()
                    .expect("accepted poisoned")
                    .values()
                    .filter(|(name, _, _)| *name == l.state.peer.name)
                    .map(|(_, _, c)| c.clone())
                    .collect();
                for c in conns {
                    c.close(VarInt::from_u32(close::SHUTDOWN), b"forgotten");
                }
            }
            tracing::info!(peer = %l.state.peer.name, "forgot a joined node");
        }
    }

    fn reconnect(&self, to: NodeId) {
        if let Some(l) = self.link(to)
            && l.state.phase.load(Ordering::Acquire) == UP
        {
            l.state.phase.store(DOWN, Ordering::Release);
            l.state.reset.notify_one();
        }
        // The bulk connection reaches the old life too: the next transfer
        // dials a new one.
        if let Some(l) = self.link(to)
            && let Ok(mut bulk) = l.state.bulk.try_lock()
            && let Some(c) = bulk.take()
        {
            c.close(VarInt::from_u32(close::SHUTDOWN), b"peer restarted");
        }
    }
}

/// Asks for socket buffers of `SOCKET_BUFFER_BYTES`; the kernel caps the
/// request at `net.core.rmem_max` / `wmem_max`. The default (208 KiB on
/// Linux) holds three 64 KiB datagrams: a bulk transfer overflows it, and
/// every datagram dropped there is a loss that halves the congestion
/// window.
fn size_socket_buffers(socket: &std::net::UdpSocket) {
    let s = socket2::SockRef::from(socket);
    let _ = s.set_recv_buffer_size(SOCKET_BUFFER_BYTES);
    let _ = s.set_send_buffer_size(SOCKET_BUFFER_BYTES);
    tracing::debug!(
        recv = ?s.recv_buffer_size(),
        send = ?s.send_buffer_size(),
        "UDP socket buffers"
    );
}

/// `gso`: batch datagrams with segmentation offload (bulk connections on
/// ordinary paths); otherwise one datagram per call, up to 64 KiB.
fn transport_config(opts: &QuicOptions, gso: bool) -> Result<quinn::TransportConfig, StartError> {
    let mut tc = quinn::TransportConfig::default();
    tc.keep_alive_interval(Some(opts.keep_alive));
    tc.max_idle_timeout(Some(
        quinn::IdleTimeout::try_from(opts.idle_timeout)
            .map_err(|_| StartError::Options("idle timeout out of range".into()))?,
    ));
    // Loopback and jumbo-frame links get large packets after discovery;
    // ordinary Ethernet settles at its 1500.
    let mut mtu = quinn::MtuDiscoveryConfig::default();
    mtu.upper_bound(if gso {
        MTU_GSO_MAX_BYTES
    } else {
        MTU_MAX_BYTES
    });
    tc.mtu_discovery_config(Some(mtu));
    tc.enable_segmentation_offload(gso);
    Ok(tc)
}

/// Hands every frame queued for peer `to` back to the node as
/// [`Inbound::Undelivered`]: the link dropped them, so the node's protocol
/// acts on each as on a send refused at once.
fn give_back(
    rx: &mut mpsc::Receiver<Vec<u8>>,
    to: NodeId,
    cap: u32,
    in_tx: &Sink,
    counters: &Counters,
) {
    while let Ok(frame) = rx.try_recv() {
        // Our own encoding: it decodes.
        let Ok((_, msg)) = wire::decode_frame(&frame, cap) else {
            continue;
        };
        counters.undelivered.fetch_add(1, Ordering::Relaxed);
        in_tx.deliver(Inbound::Undelivered {
            to,
            msg,
            reason: SendFailure::PeerGone,
        });
    }
}

/// Dials one peer, keeps the connection, and writes its queued frames in
/// order on one control stream; reconnects with capped exponential backoff.
#[allow(clippy::too_many_arguments)]
async fn run_link(
    endpoint: Endpoint,
    to: NodeId,
    mut rx: mpsc::Receiver<Vec<u8>>,
    state: Arc<LinkState>,
    opts: Arc<QuicOptions>,
    counters: Arc<Counters>,
    closed: Arc<AtomicBool>,
    in_tx: Sink,
    revoked: Arc<Revocations>,
) {
    let peer = state.peer.clone();
    let cap = opts.frame_len_max_bytes;
    let mut backoff = Duration::from_millis(20);
    let mut batch: Vec<u8> = Vec::new();
    let mut n: u64 = 0;
    loop {
        if rx.is_closed() {
            return;
        }
        let dialed = dial(&endpoint, &peer, opts.connect_timeout)
            .await
            .and_then(|c| match revoked_peer(&c, &revoked) {
                Some(why) => {
                    tracing::warn!(peer = %peer.name, "not dialing: {why}");
                    c.close(VarInt::from_u32(close::FORBIDDEN), b"revoked");
                    Err(why.to_string())
                }
                None => Ok(c),
            });
        let conn = match dialed {
            Ok(c) => c,
            Err(e) => {
                if closed.load(Ordering::Acquire) {
                    return;
                }
                tracing::debug!(peer = %peer.name, "connect failed: {e}");
                state.phase.store(DOWN, Ordering::Release);
                // Frames queued for a peer that cannot be reached (sent
                // while the link was still dialing) go back to the node,
                // which fails or re-runs what each was for.
                give_back(&mut rx, to, cap, &in_tx, &counters);
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = state.wake.notified() => {}
                }
                backoff = (backoff * 2).min(opts.reconnect_backoff_max);
                continue;
            }
        };
        let bulk_addr = match read_hello(&conn, opts.connect_timeout).await {
            Ok(a) => a,
            Err(e) => {
                // A peer that refuses us (revoked, unknown) is dialed again
                // as slowly as one that cannot be reached.
                tracing::warn!(peer = %peer.name, "no hello: {e}");
                conn.close(VarInt::from_u32(close::PROTOCOL), b"no hello");
                state.phase.store(DOWN, Ordering::Release);
                give_back(&mut rx, to, cap, &in_tx, &counters);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(opts.reconnect_backoff_max);
                continue;
            }
        };
        backoff = Duration::from_millis(20);
        let mut stream = match conn.open_uni().await {
            Ok(s) => s,
            Err(_) => continue,
        };
        *state.bulk_addr.lock().expect("link state poisoned") = Some(bulk_addr);
        *state.conn.lock().expect("link state poisoned") = Some(conn.clone());
        state.phase.store(UP, Ordering::Release);
        counters.connects.fetch_add(1, Ordering::Relaxed);
        loop {
            let first = tokio::select! {
                f = rx.recv() => f,
                _ = conn.closed() => break,
                _ = state.reset.notified() => {
                    conn.close(VarInt::from_u32(close::SHUTDOWN), b"peer restarted");
                    break;
                }
            };
            let Some(first) = first else {
                conn.close(VarInt::from_u32(close::SHUTDOWN), b"shutdown");
                return;
            };
            // Everything already queued goes out in one write.
            batch.clear();
            batch.extend_from_slice(&first);
            while batch.len() < 1 << 20 {
                match rx.try_recv() {
                    Ok(f) => batch.extend_from_slice(&f),
                    Err(_) => break,
                }
            }
            if !opts.faults.delay.is_zero() {
                n += 1;
                let lost =
                    opts.faults.loss_one_in > 0 && n.is_multiple_of(opts.faults.loss_one_in as u64);
                let d = if lost {
                    opts.faults.delay * 4
                } else {
                    opts.faults.delay
                };
                tokio::time::sleep(d).await;
            }
            if stream.write_all(&batch).await.is_err() {
                break;
            }
        }
        state.phase.store(DOWN, Ordering::Release);
        *state.conn.lock().expect("link state poisoned") = None;
        give_back(&mut rx, to, cap, &in_tx, &counters);
        tracing::info!(peer = %peer.name, "connection lost; reconnecting");
    }
}

/// The peer's bulk endpoint, from the hello the peer sends first on a
/// control connection we dialed: its port, at the address we reached it on.
async fn read_hello(conn: &Connection, timeout: Duration) -> Result<SocketAddr, String> {
    let read = async {
        let mut r = conn.accept_uni().await.map_err(|e| e.to_string())?;
        let mut b = [0u8; 8];
        r.read_exact(&mut b).await.map_err(|e| e.to_string())?;
        if b[..4] != HELLO_MAGIC {
            return Err("hello has the wrong magic".to_string());
        }
        let version = u16::from_be_bytes([b[4], b[5]]);
        if version != wire::PROTOCOL_VERSION {
            return Err(format!(
                "peer speaks protocol {version}, this node {}",
                wire::PROTOCOL_VERSION
            ));
        }
        Ok(SocketAddr::new(
            conn.remote_address().ip(),
            u16::from_be_bytes([b[6], b[7]]),
        ))
    };
    tokio::time::timeout(timeout, read)
        .await
        .map_err(|_| "hello timed out".to_string())?
}

/// The accepting side of the hello: our bulk port, on a uni stream of the
/// control connection a peer dialed.
async fn send_hello(conn: &Connection, bulk_port: u16) -> Result<(), String> {
    let mut s = conn.open_uni().await.map_err(|e| e.to_string())?;
    let mut b = [0u8; 8];
    b[..4].copy_from_slice(&HELLO_MAGIC);
    b[4..6].copy_from_slice(&wire::PROTOCOL_VERSION.to_be_bytes());
    b[6..].copy_from_slice(&bulk_port.to_be_bytes());
    s.write_all(&b).await.map_err(|e| e.to_string())?;
    s.finish().map_err(|e| e.to_string())
}

async fn dial(
    endpoint: &Endpoint,
    peer: &PeerSpec,
    timeout: Duration,
) -> Result<Connection, String> {
    let addr = tokio::net::lookup_host(&peer.addr)
        .await
        .map_err(|e| format!("resolving {}: {e}", peer.addr))?
        .next()
        .ok_or_else(|| format!("{} resolves to nothing", peer.addr))?;
    let connecting = endpoint
        .connect(addr, &peer.name)
        .map_err(|e| e.to_string())?;
    check_identity(connecting, peer, timeout).await
}

/// Dials `peer`'s bulk endpoint at `addr` with `config`.
async fn dial_addr(
    endpoint: &Endpoint,
    addr: SocketAddr,
    peer: &PeerSpec,
    timeout: Duration,
    config: quinn::ClientConfig,
) -> Result<Connection, String> {
    let connecting = endpoint
        .connect_with(config, addr, &peer.name)
        .map_err(|e| e.to_string())?;
    check_identity(connecting, peer, timeout).await
}

/// Completes a dial: the handshake within `timeout`, and the certificate
/// of the node we meant to reach.
async fn check_identity(
    connecting: quinn::Connecting,
    peer: &PeerSpec,
    timeout: Duration,
) -> Result<Connection, String> {
    let conn = tokio::time::timeout(timeout, connecting)
        .await
        .map_err(|_| "connect timed out".to_string())?
        .map_err(|e| e.to_string())?;
    // The server's certificate chains to our CA (checked by rustls); it must
    // also be the node we meant to reach, in its configured role.
    let id = tls::peer_identity(&conn).map_err(|e| e.to_string())?;
    if id.name != peer.name || id.role != peer.role {
        conn.close(VarInt::from_u32(close::UNKNOWN_NODE), b"wrong identity");
        return Err(format!(
            "{} answered as {} ({}), expected {} ({})",
            conn.remote_address(),
            id.name,
            id.role,
            peer.name,
            peer.role
        ));
    }
    Ok(conn)
}

/// Which endpoint a connection arrived on.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Plane {
    /// The control endpoint: control streams only; we say our bulk port.
    Control { bulk_port: u16 },
    /// The bulk endpoint: one transfer per stream.
    Bulk,
}

/// The revocation that names the peer on `conn`, if any.
fn revoked_peer(conn: &Connection, revoked: &Revocations) -> Option<Refusal> {
    let id = tls::peer_identity(conn).ok()?;
    let serial = tls::peer_serial(conn).unwrap_or_default();
    revoked
        .names(&id.name, &serial)
        .map(|list| Refusal::Revoked {
            name: id.name,
            serial,
            list,
        })
}

/// Connections accepted and open, by quinn's stable id: (name, serial,
/// connection), so a revocation cuts them off.
type Accepted = Arc<Mutex<BTreeMap<usize, (String, String, Connection)>>>;

/// Reads the revocation list again each `every`; when it changed, closes
/// the connections of every peer it now names, both ways (the links'
/// redials are refused at the handshake check while it stays there).
async fn watch_revocations(
    revoked: Arc<Revocations>,
    peers: Arc<Peers>,
    accepted: [Accepted; 2],
    every: Duration,
    closed: Arc<AtomicBool>,
) {
    let mut seen = revoked.generation();
    loop {
        tokio::time::sleep(every).await;
        if closed.load(Ordering::Acquire) {
            return;
        }
        revoked.refresh();
        let now = revoked.generation();
        if now == seen {
            continue;
        }
        seen = now;
        for a in &accepted {
            let conns: Vec<_> = a
                .lock()
                .expect("accepted poisoned")
                .values()
                .cloned()
                .collect();
            for (name, serial, conn) in conns {
                if let Some(list) = revoked.names(&name, &serial) {
                    let why = Refusal::Revoked {
                        name: name.clone(),
                        serial,
                        list,
                    };
                    tracing::warn!(peer = %name, "closing connection: {why}");
                    conn.close(VarInt::from_u32(close::FORBIDDEN), b"revoked");
                }
            }
        }
        for state in peers.states() {
            let conn = state.conn.lock().expect("link state poisoned").clone();
            if let Some(conn) = conn
                && let Some(why) = revoked_peer(&conn, &revoked)
            {
                tracing::warn!(peer = %state.peer.name, "closing link: {why}");
                conn.close(VarInt::from_u32(close::FORBIDDEN), b"revoked");
            }
        }
    }
}

/// Accepts peers on one endpoint and reads what they send.
#[derive(Clone)]
struct Accept {
    endpoint: Endpoint,
    plane: Plane,
    peers: Arc<Peers>,
    ctx: Arc<LinkCtx>,
    conns: Accepted,
    opts: Arc<QuicOptions>,
    in_tx: Sink,
    epochs: Arc<EpochFilter>,
    counters: Arc<Counters>,
    bufs: Arc<RecvBuffers>,
}

impl Accept {
    async fn run(self) {
        while let Some(incoming) = self.endpoint.accept().await {
            let a = self.clone();
            tokio::spawn(async move {
                let remote = incoming.remote_address();
                let conn = match incoming.await {
                    Ok(c) => c,
                    Err(e) => {
                        // Handshake failed: no client certificate, another CA, ...
                        a.counters
                            .connections_refused
                            .fetch_add(1, Ordering::Relaxed);
                        // Our own TLS check failed (no certificate, another
                        // CA): say why. A dialer that gave up mid-handshake
                        // (its timeout, its shutdown) is no refusal.
                        let ours = matches!(e, quinn::ConnectionError::TransportError(_));
                        let why = Refusal::Handshake(e.to_string());
                        if ours {
                            tracing::warn!(%remote, "refused a connection: {why}");
                        } else {
                            tracing::debug!(%remote, "handshake ended: {e}");
                        }
                        return;
                    }
                };
                let (from, role, name, serial) = match a.admit(&conn) {
                    Ok(v) => v,
                    Err((code, why)) => {
                        a.counters
                            .connections_refused
                            .fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(%remote, "refused a connection: {why}");
                        conn.close(VarInt::from_u32(code), why.to_string().as_bytes());
                        return;
                    }
                };
                a.conns
                    .lock()
                    .expect("accepted poisoned")
                    .insert(conn.stable_id(), (name, serial, conn.clone()));
                if let Plane::Control { bulk_port } = a.plane {
                    if let Err(e) = send_hello(&conn, bulk_port).await {
                        tracing::debug!(peer = from, "hello not sent: {e}");
                        return;
                    }
                    // A peer that dials us is up: our own link to it redials
                    // now rather than at the end of its backoff.
                    if let Some(link) = a.peers.get(from)
                        && link.state.phase.load(Ordering::Acquire) == DOWN
                    {
                        link.state.wake.notify_one();
                    }
                }
                while let Ok(recv) = conn.accept_uni().await {
                    tokio::spawn(read_stream(recv, conn.clone(), from, role, a.clone()));
                }
                a.conns
                    .lock()
                    .expect("accepted poisoned")
                    .remove(&conn.stable_id());
            });
        }
    }

    /// Who the peer on `conn` is, if it may talk to this node: (id, role,
    /// name, serial). A node not in the config that may join becomes a
    /// peer here (on the control endpoint; its bulk connection comes
    /// after), reached back at the address it dialed from: its endpoint's.
    #[allow(clippy::type_complexity)]
    fn admit(&self, conn: &Connection) -> Result<(NodeId, Role, String, String), (u32, Refusal)> {
        let id = tls::peer_identity(conn)
            .map_err(|e| (close::FORBIDDEN, Refusal::Handshake(e.to_string())))?;
        let serial = tls::peer_serial(conn).unwrap_or_default();
        self.ctx.revoked.refresh();
        let a = members::admit(
            &id.name,
            id.role,
            &serial,
            &self.opts.nodes,
            self.opts.node,
            &self.opts.join,
            &self.ctx.revoked,
            &self.peers.joined_names(),
        )
        .map_err(|r| {
            let code = match r {
                Refusal::Revoked { .. }
                | Refusal::WrongRole { .. }
                | Refusal::RoleMayNotJoin { .. } => close::FORBIDDEN,
                _ => close::UNKNOWN_NODE,
            };
            (code, r)
        })?;
        if a.joined {
            let peer = JoinedPeer {
                node: a.node,
                name: id.name.clone(),
                role: a.role,
                addr: conn.remote_address().to_string(),
            };
            match self.plane {
                Plane::Control { .. } => {
                    if add_joined(&self.peers, &self.ctx, &self.epochs, &peer) {
                        tracing::info!(peer = %peer.name, addr = %peer.addr, role = %peer.role, "a node joined");
                    }
                    // Before anything it sends: the shell learns who it is.
                    self.in_tx.deliver(Inbound::Joined(peer));
                }
                Plane::Bulk => {
                    if self.peers.get(a.node).is_none() {
                        return Err((close::UNKNOWN_NODE, Refusal::NotInConfig { name: id.name }));
                    }
                }
            }
        }
        Ok((a.node, a.role, id.name, serial))
    }
}

/// Reads frames from one uni stream: on the control endpoint, a control
/// stream (frames until the stream ends, never `KvBlocks`); on the bulk
/// endpoint, a bulk stream (one `KvBlocks` frame, then its bytes).
async fn read_stream(mut recv: RecvStream, conn: Connection, from: NodeId, role: Role, a: Accept) {
    let Accept {
        opts,
        in_tx,
        epochs,
        counters,
        bufs,
        plane,
        ..
    } = a;
    let refuse = |code: u32, why: &str, counter: &std::sync::atomic::AtomicU64| {
        counter.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(peer = from, "closing connection: {why}");
        conn.close(VarInt::from_u32(code), why.as_bytes());
    };
    let mut head = [0u8; HEADER_LEN];
    let mut payload = Vec::new();
    loop {
        match recv.read_exact(&mut head).await {
            Ok(()) => {}
            // The stream ended at a frame boundary: the peer is done with it.
            Err(quinn::ReadExactError::FinishedEarly(0)) => return,
            Err(_) => return,
        }
        let header = match Header::decode(&head, opts.frame_len_max_bytes) {
            Ok(h) => h,
            Err(e) => return refuse(close::PROTOCOL, &e.to_string(), &counters.frames_invalid),
        };
        if header.sender != from {
            return refuse(
                close::PROTOCOL,
                "envelope sender differs from certificate",
                &counters.frames_invalid,
            );
        }
        if !header.kind.may_send(role) {
            let why = format!("role {role} may not send {:?}", header.kind);
            return refuse(close::FORBIDDEN, &why, &counters.frames_forbidden);
        }
        payload.resize(header.len as usize, 0);
        if recv.read_exact(&mut payload).await.is_err() {
            return;
        }
        let msg = match decode_payload(&header, &payload) {
            Ok(m) => m,
            Err(e) => return refuse(close::PROTOCOL, &e.to_string(), &counters.frames_invalid),
        };
        let current = epochs.admit(from, header.epoch);
        if matches!(msg, Message::KvBlocks(_)) != (plane == Plane::Bulk) {
            let why = match plane {
                Plane::Bulk => "a control frame on the bulk endpoint",
                Plane::Control { .. } => "a bulk transfer on the control endpoint",
            };
            return refuse(close::PROTOCOL, why, &counters.frames_invalid);
        }
        if let Message::KvBlocks(h) = msg {
            if h.bytes > opts.bulk_len_max_bytes {
                let why = format!(
                    "bulk transfer of {} bytes over the cap of {}",
                    h.bytes, opts.bulk_len_max_bytes
                );
                return refuse(close::PROTOCOL, &why, &counters.frames_invalid);
            }
            // Each chunk is copied out of quinn's datagram buffer at once, so
            // that buffer is reused for the next datagram, into a kept
            // buffer whose pages are already in.
            let mut buf = bufs.take(h.bytes as usize);
            while (buf.len() as u64) < h.bytes {
                match recv
                    .read_chunk((h.bytes - buf.len() as u64) as usize, true)
                    .await
                {
                    Ok(Some(c)) => buf.extend_from_slice(&c.bytes),
                    _ => {
                        bufs.give(buf);
                        return;
                    }
                }
            }
            let data = vec![Bytes::from_owner(PooledBuf {
                buf,
                pool: bufs.clone(),
            })];
            if !current {
                counters.frames_stale_epoch.fetch_add(1, Ordering::Relaxed);
                return;
            }
            in_tx.deliver(Inbound::Bulk {
                from,
                epoch: header.epoch,
                header: h,
                data,
            });
            return;
        }
        if !current {
            counters.frames_stale_epoch.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let inbound = Inbound::Message {
            from,
            epoch: header.epoch,
            correlation: header.correlation,
            msg,
        };
        if !in_tx.deliver(inbound) {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_received_transfer_s_buffer_is_reused_once_its_bytes_are_dropped() {
        let pool = Arc::new(RecvBuffers::default());
        let mut buf = pool.take(1000);
        assert!(buf.capacity() >= 1000);
        buf.extend_from_slice(&[5; 1000]);
        let ptr = buf.as_ptr();
        let data = Bytes::from_owner(PooledBuf {
            buf,
            pool: pool.clone(),
        });
        let part = data.slice(10..20);
        drop(data);
        // Still referenced by `part`: not back yet.
        assert!(pool.free.lock().unwrap().is_empty());
        assert_eq!(&part[..], &[5; 10]);
        drop(part);
        let again = pool.take(600);
        assert_eq!(again.as_ptr(), ptr, "the kept buffer is handed out again");
        assert!(again.is_empty(), "handed out empty");
    }

    #[test]
    fn the_pool_keeps_a_bounded_number_of_the_largest_buffers() {
        let pool = RecvBuffers::default();
        for len in [10, 20, 30, 40, 50, 5] {
            pool.give(Vec::with_capacity(len));
        }
        let mut caps: Vec<usize> = pool
            .free
            .lock()
            .unwrap()
            .iter()
            .map(|b| b.capacity())
            .collect();
        caps.sort();
        assert_eq!(caps, [20, 30, 40, 50]);
        // The smallest that fits, and a grown one when none does.
        assert_eq!(pool.take(25).capacity(), 30);
        assert!(pool.take(100).capacity() >= 100);
        assert_eq!(pool.free.lock().unwrap().len(), 2);
    }
}
