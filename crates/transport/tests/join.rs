//! Nodes that join at run time, over real QUIC on loopback: a node not in
//! the config is admitted on its certificate and reached back at the
//! address it dialed from; a foreign CA, a role that may not join, a role
//! the config does not give and a revoked certificate are each refused,
//! the reason in the log.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flotilla_proto::wire::{JoinedPeer, Message};
use flotilla_proto::{EngineStatus, Role, joined_node_id};
use flotilla_transport::members::JoinPolicy;
use flotilla_transport::quic::{LinkFaults, PeerSpec, QuicOptions, QuicTransport};
use flotilla_transport::tls::{self, TlsMaterial};
use flotilla_transport::{Inbound, SendFailure, Transport};
use tokio::sync::mpsc;

fn free_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// What the transports log, for the refusals' reasons.
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Log {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Log {
    /// Captures this thread's log (the tests run on one thread).
    fn capture() -> (Log, tracing::subscriber::DefaultGuard) {
        let log = Log::default();
        let w = log.clone();
        let sub = tracing_subscriber::fmt()
            .with_writer(move || w.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .finish();
        (log, tracing::subscriber::set_default(sub))
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    /// Waits up to 5 s for a line with `what`.
    async fn wait_for(&self, what: &str) -> String {
        for _ in 0..500 {
            if let Some(l) = self.text().lines().find(|l| l.contains(what)) {
                return l.to_owned();
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("no log line with {what:?} in:\n{}", self.text());
    }
}

/// A config of a router and a worker; the router takes joiners and reads
/// `revoked.txt` beside the certificates.
struct Cluster {
    dir: tempfile::TempDir,
    nodes: Vec<PeerSpec>,
}

impl Cluster {
    fn new() -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        tls::init_ca(dir.path()).unwrap();
        let nodes = [("router", Role::Router), ("worker-1", Role::Worker)]
            .iter()
            .map(|(name, role)| {
                tls::issue(dir.path(), name, *role).unwrap();
                PeerSpec {
                    name: name.to_string(),
                    role: *role,
                    addr: format!("127.0.0.1:{}", free_port()),
                }
            })
            .collect();
        Cluster { dir, nodes }
    }

    fn revoked(&self) -> PathBuf {
        self.dir.path().join("revoked.txt")
    }

    fn opts(&self, node: u32, joining: Option<PeerSpec>) -> QuicOptions {
        let listen = match &joining {
            Some(_) => format!("127.0.0.1:{}", free_port()),
            None => self.nodes[node as usize].addr.clone(),
        };
        QuicOptions {
            node,
            nodes: self.nodes.clone(),
            listen: listen.parse::<SocketAddr>().unwrap(),
            bulk_port: 0,
            epoch: 1,
            frame_len_max_bytes: 1 << 20,
            send_queue_len_max: 1024,
            bulk_len_max_bytes: 1 << 30,
            keep_alive: Duration::from_millis(100),
            idle_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_millis(300),
            reconnect_backoff_max: Duration::from_millis(100),
            faults: LinkFaults::default(),
            joining,
            join: JoinPolicy {
                accept: node == 0,
                revoked: Some(self.revoked()),
            },
        }
    }

    fn router(&self) -> (Arc<QuicTransport>, mpsc::UnboundedReceiver<Inbound>) {
        let m = TlsMaterial::load(self.dir.path(), "router").unwrap();
        QuicTransport::start_channel(self.opts(0, None), &m).unwrap()
    }

    /// A node not in the config, with the certificate for `name` in `certs`.
    fn joiner(
        &self,
        certs: &Path,
        name: &str,
        role: Role,
    ) -> (Arc<QuicTransport>, mpsc::UnboundedReceiver<Inbound>) {
        let me = PeerSpec {
            name: name.into(),
            role,
            addr: String::new(),
        };
        let m = TlsMaterial::load(certs, name).unwrap();
        let opts = self.opts(joined_node_id(name), Some(me));
        QuicTransport::start_channel(opts, &m).unwrap()
    }
}

fn heartbeat() -> Message {
    Message::Heartbeat(EngineStatus::default())
}

async fn next(rx: &mut mpsc::UnboundedReceiver<Inbound>) -> Inbound {
    tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .expect("nothing arrived within 5 s")
        .expect("transport closed")
}

/// Sends until `to` has it queued on a live link.
async fn send_when_up(t: &QuicTransport, to: u32, msg: Message) {
    for _ in 0..300 {
        if t.is_connected(to) && t.send(to, 0, msg.clone()).is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("link to {to} never came up");
}

#[tokio::test]
async fn a_node_not_in_the_config_joins_and_is_reached_back() {
    let (log, _g) = Log::capture();
    let c = Cluster::new();
    tls::issue(c.dir.path(), "worker-9", Role::Worker).unwrap();
    let (router, mut router_rx) = c.router();
    let (joiner, mut joiner_rx) = c.joiner(c.dir.path(), "worker-9", Role::Worker);
    let id = joined_node_id("worker-9");

    send_when_up(&joiner, 0, heartbeat()).await;
    // Who it is comes first, then what it said.
    let Inbound::Joined(peer) = next(&mut router_rx).await else {
        panic!("expected the join first");
    };
    assert_eq!(
        (peer.node, peer.name.as_str(), peer.role),
        (id, "worker-9", Role::Worker)
    );
    assert_eq!(peer.addr, joiner.local_addr().unwrap().to_string());
    match next(&mut router_rx).await {
        Inbound::Message { from, msg, .. } => {
            assert_eq!(from, id);
            assert_eq!(msg, heartbeat());
        }
        other => panic!("expected its heartbeat, got {other:?}"),
    }
    log.wait_for("a node joined").await;

    // The router reaches it back at the address it dialed from.
    send_when_up(
        &router,
        id,
        Message::Ping {
            seq: 7,
            pad: vec![],
        },
    )
    .await;
    match next(&mut joiner_rx).await {
        Inbound::Message { from, msg, .. } => {
            assert_eq!(from, 0);
            assert_eq!(
                msg,
                Message::Ping {
                    seq: 7,
                    pad: vec![]
                }
            );
        }
        other => panic!("expected the router's ping, got {other:?}"),
    }

    // A worker of the config that never heard of it learns it from a
    // Router's word and dials it.
    let m = TlsMaterial::load(c.dir.path(), "worker-1").unwrap();
    let (worker, _worker_rx) = QuicTransport::start_channel(c.opts(1, None), &m).unwrap();
    assert!(matches!(
        worker.send(id, 0, heartbeat()).map_err(|e| e.reason),
        Err(SendFailure::UnknownPeer)
    ));
    worker.learn(&JoinedPeer {
        node: id,
        name: "worker-9".into(),
        role: Role::Worker,
        addr: peer.addr.clone(),
    });
    send_when_up(
        &worker,
        id,
        Message::Ping {
            seq: 8,
            pad: vec![],
        },
    )
    .await;
    match next(&mut joiner_rx).await {
        Inbound::Message { from, msg, .. } => {
            assert_eq!(
                (from, msg),
                (
                    1,
                    Message::Ping {
                        seq: 8,
                        pad: vec![]
                    }
                )
            );
        }
        other => panic!("expected worker-1's ping, got {other:?}"),
    }

    // Forgotten: unknown again.
    router.forget(id);
    assert!(matches!(
        router.send(id, 0, heartbeat()).map_err(|e| e.reason),
        Err(SendFailure::UnknownPeer)
    ));
    assert_eq!(router.stats().connections_refused, 0);
}

#[tokio::test]
async fn a_foreign_ca_a_router_not_in_the_config_and_a_wrong_role_are_refused_with_reasons() {
    let (log, _g) = Log::capture();
    let c = Cluster::new();
    let (router, mut router_rx) = c.router();

    // Another cluster's certificate, beside our CA (so the joiner would
    // take our router; the router must not take it).
    let theirs = tempfile::tempdir().unwrap();
    tls::init_ca(theirs.path()).unwrap();
    tls::issue(theirs.path(), "worker-5", Role::Worker).unwrap();
    std::fs::copy(c.dir.path().join("ca.pem"), theirs.path().join("ca.pem")).unwrap();
    let (foreign, _f) = c.joiner(theirs.path(), "worker-5", Role::Worker);
    let _ = foreign.send(0, 0, heartbeat());
    let line = log
        .wait_for("refused a connection: TLS handshake failed")
        .await;
    assert!(line.contains("not signed by this cluster's CA"), "{line}");

    // A router certificate for a name the config does not have.
    tls::issue(c.dir.path(), "router-9", Role::Router).unwrap();
    let (rogue, _r) = c.joiner(c.dir.path(), "router-9", Role::Router);
    let _ = rogue.send(0, 0, heartbeat());
    let line = log.wait_for("a router may not join at run time").await;
    assert!(
        line.contains("router-9 (router) is not in the config"),
        "{line}"
    );

    // A config node's name with another role in its certificate (the CA
    // signed it: a mistake, or a stolen name).
    let other = tempfile::tempdir().unwrap();
    for f in ["ca.pem", "ca.key"] {
        std::fs::copy(c.dir.path().join(f), other.path().join(f)).unwrap();
    }
    tls::issue(other.path(), "worker-1", Role::Prefill).unwrap();
    let mut nodes = c.nodes.clone();
    nodes[1].role = Role::Prefill;
    let m = TlsMaterial::load(other.path(), "worker-1").unwrap();
    let mut opts = c.opts(1, None);
    opts.nodes = nodes;
    let (wrong, _w) = QuicTransport::start_channel(opts, &m).unwrap();
    let _ = wrong.send(0, 0, heartbeat());
    let line = log
        .wait_for("certificate of worker-1 carries role prefill; the config says worker")
        .await;
    assert!(line.contains("refused a connection"), "{line}");

    assert!(router.stats().connections_refused >= 3);
    // None of them got a word through.
    tokio::time::sleep(Duration::from_millis(100)).await;
    while let Ok(i) = router_rx.try_recv() {
        assert!(
            !matches!(i, Inbound::Message { .. } | Inbound::Joined(_)),
            "{i:?}"
        );
    }
}

#[tokio::test]
async fn a_revoked_certificate_is_refused_and_a_revocation_cuts_a_joined_node_off() {
    let (log, _g) = Log::capture();
    let c = Cluster::new();
    std::fs::write(c.revoked(), "# revoked\nworker-7\n").unwrap();
    tls::issue(c.dir.path(), "worker-7", Role::Worker).unwrap();
    tls::issue(c.dir.path(), "worker-9", Role::Worker).unwrap();
    let (router, mut router_rx) = c.router();

    let (revoked, _r) = c.joiner(c.dir.path(), "worker-7", Role::Worker);
    let _ = revoked.send(0, 0, heartbeat());
    let line = log.wait_for("is revoked by").await;
    assert!(line.contains("certificate of worker-7 (serial "), "{line}");

    // worker-9 joins and is heard...
    let (joiner, _j) = c.joiner(c.dir.path(), "worker-9", Role::Worker);
    send_when_up(&joiner, 0, heartbeat()).await;
    assert!(matches!(next(&mut router_rx).await, Inbound::Joined(_)));
    assert!(matches!(
        next(&mut router_rx).await,
        Inbound::Message { .. }
    ));
    // ... until its certificate's serial is added to the list: the router
    // reads the list again and closes its connection.
    let serial = tls::node_serial(c.dir.path(), "worker-9").unwrap();
    std::fs::write(
        c.revoked(),
        format!("worker-7\n{}  # worker-9's\n", serial.to_uppercase()),
    )
    .unwrap();
    let line = log
        .wait_for("closing connection: certificate of worker-9")
        .await;
    assert!(line.contains(&serial), "{line}");
    // Its redials are refused too: nothing more from it arrives.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = joiner.send(0, 0, heartbeat());
    tokio::time::sleep(Duration::from_millis(500)).await;
    while let Ok(i) = router_rx.try_recv() {
        assert!(!matches!(i, Inbound::Message { .. }), "{i:?}");
    }
    assert!(router.stats().connections_refused >= 2);
}
