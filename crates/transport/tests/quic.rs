//! The QUIC transport between real endpoints on loopback: delivery in
//! order, role refusal, epochs, unreachable peers, bulk transfers.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use flotilla_proto::Role;
use flotilla_proto::wire::{KvTransferHeader, Message, Submit};
use flotilla_proto::{EngineRequest, EngineStatus, Sampled, SamplingParams, TenantId};
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

struct Cluster {
    dir: tempfile::TempDir,
    nodes: Vec<PeerSpec>,
}

impl Cluster {
    fn new(roles: &[(&str, Role)]) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        tls::init_ca(dir.path()).unwrap();
        let nodes = roles
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

    fn opts(&self, node: u32, epoch: u64) -> QuicOptions {
        QuicOptions {
            node,
            nodes: self.nodes.clone(),
            listen: self.nodes[node as usize]
                .addr
                .parse::<SocketAddr>()
                .unwrap(),
            bulk_port: 0,
            epoch,
            frame_len_max_bytes: 1 << 20,
            send_queue_len_max: 1024,
            bulk_len_max_bytes: 1 << 30,
            keep_alive: Duration::from_millis(200),
            idle_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_millis(300),
            reconnect_backoff_max: Duration::from_millis(200),
            faults: LinkFaults::default(),
            joining: None,
            join: flotilla_transport::members::JoinPolicy::default(),
        }
    }

    fn start(
        &self,
        node: u32,
        epoch: u64,
    ) -> (Arc<QuicTransport>, mpsc::UnboundedReceiver<Inbound>) {
        let m = TlsMaterial::load(self.certs(), &self.nodes[node as usize].name).unwrap();
        QuicTransport::start_channel(self.opts(node, epoch), &m).unwrap()
    }

    fn certs(&self) -> &Path {
        self.dir.path()
    }
}

/// Sends `msg` until the link is up and it is queued (the first sends race
/// the handshake).
async fn send_when_up(t: &QuicTransport, to: u32, corr: u64, msg: Message) {
    let mut msg = msg;
    for _ in 0..200 {
        if t.is_connected(to) {
            match t.send(to, corr, msg) {
                Ok(()) => return,
                Err(e) => msg = *e.msg,
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("link to {to} never came up");
}

async fn next(rx: &mut mpsc::UnboundedReceiver<Inbound>) -> Inbound {
    tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .expect("nothing arrived within 5 s")
        .expect("transport closed")
}

fn submit(req: u64) -> Message {
    Message::Submit(Submit {
        req,
        attempt: 0,
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
    })
}

#[tokio::test]
async fn messages_arrive_in_order_with_sender_and_epoch() {
    let c = Cluster::new(&[("router", Role::Router), ("worker-1", Role::Worker)]);
    let (r, _rrx) = c.start(0, 11);
    let (_w, mut wrx) = c.start(1, 22);
    send_when_up(&r, 1, 0, submit(0)).await;
    for i in 1..200u64 {
        r.send(1, i, submit(i)).unwrap();
    }
    for i in 0..200u64 {
        match next(&mut wrx).await {
            Inbound::Message {
                from,
                epoch,
                correlation,
                msg: Message::Submit(s),
            } => {
                assert_eq!((from, epoch, correlation, s.req), (0, 11, i, i));
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}

#[tokio::test]
async fn a_role_that_may_not_send_a_kind_is_refused() {
    let c = Cluster::new(&[
        ("router", Role::Router),
        ("worker-1", Role::Worker),
        ("worker-2", Role::Worker),
    ]);
    let (w1, _rx1) = c.start(1, 1);
    let (w2, mut rx2) = c.start(2, 1);
    // The sender's own check refuses it first...
    let e = w1.send(2, 5, submit(5)).unwrap_err();
    assert_eq!(e.reason, SendFailure::Forbidden(Role::Worker));
    assert!(
        matches!(*e.msg, Message::Submit(_)),
        "the message comes back"
    );
    // ...and a peer that skips it is refused by the receiver, which closes
    // the connection and delivers nothing.
    send_when_up(&w1, 2, 0, Message::Heartbeat(EngineStatus::default())).await;
    assert!(matches!(
        next(&mut rx2).await,
        Inbound::Message {
            msg: Message::Heartbeat(_),
            ..
        }
    ));
    w1.send_unchecked(2, 5, submit(5)).unwrap();
    let mut refused = false;
    for _ in 0..100 {
        if w2.stats().frames_forbidden == 1 {
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        refused,
        "receiver never counted the forbidden frame: {:?}",
        w2.stats()
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(200), rx2.recv())
            .await
            .is_err(),
        "a forbidden frame was delivered"
    );
}

#[tokio::test]
async fn a_restarted_node_is_heard_and_its_old_life_is_dropped() {
    let c = Cluster::new(&[("router", Role::Router), ("worker-1", Role::Worker)]);
    let (_r, mut rrx) = c.start(0, 1);
    let (old, _orx) = c.start(1, 100);
    send_when_up(&old, 0, 0, Message::Heartbeat(EngineStatus::default())).await;
    assert!(matches!(
        next(&mut rrx).await,
        Inbound::Message { epoch: 100, .. }
    ));
    // The new life binds another port (the old one is still open here).
    let mut opts = c.opts(1, 200);
    opts.listen = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let m = TlsMaterial::load(c.certs(), "worker-1").unwrap();
    let (new, _nrx) = QuicTransport::start_channel(opts, &m).unwrap();
    send_when_up(&new, 0, 0, Message::Heartbeat(EngineStatus::default())).await;
    assert!(matches!(
        next(&mut rrx).await,
        Inbound::Message { epoch: 200, .. }
    ));
    old.send(0, 0, Message::Heartbeat(EngineStatus::default()))
        .unwrap();
    new.send(
        0,
        0,
        Message::Heartbeat(EngineStatus {
            steps: 7,
            ..Default::default()
        }),
    )
    .unwrap();
    match next(&mut rrx).await {
        Inbound::Message {
            epoch,
            msg: Message::Heartbeat(l),
            ..
        } => {
            assert_eq!(
                (epoch, l.steps),
                (200, 7),
                "the old epoch's frame got through"
            );
        }
        other => panic!("unexpected {other:?}"),
    }
    let mut dropped = false;
    for _ in 0..100 {
        if _r.stats().frames_stale_epoch >= 1 {
            dropped = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(dropped, "stale frame not counted: {:?}", _r.stats());
}

#[tokio::test]
async fn an_unreachable_peer_is_a_clear_error_and_the_message_comes_back() {
    let c = Cluster::new(&[("router", Role::Router), ("worker-1", Role::Worker)]);
    let (r, _rx) = c.start(0, 1);
    // worker-1 never starts: once the first dial fails, sends fail fast.
    let mut last = None;
    for _ in 0..300 {
        match r.send(1, 9, submit(9)) {
            Err(e) if e.reason == SendFailure::PeerGone => {
                last = Some(e);
                break;
            }
            _ => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
    let e = last.expect("send to a dead peer never failed");
    assert!(matches!(*e.msg, Message::Submit(ref s) if s.req == 9));
    assert!(e.to_string().contains("unreachable"), "{e}");
    assert_eq!(
        r.send(7, 0, submit(1)).unwrap_err().reason,
        SendFailure::UnknownPeer
    );
    // The link keeps retrying: when the peer starts, it comes up.
    let (_w, mut wrx) = c.start(1, 1);
    send_when_up(&r, 1, 3, submit(3)).await;
    assert!(matches!(
        next(&mut wrx).await,
        Inbound::Message { correlation: 3, .. }
    ));
}

#[tokio::test]
async fn what_was_queued_while_a_dial_failed_comes_back_undelivered() {
    let c = Cluster::new(&[("router", Role::Router), ("worker-1", Role::Worker)]);
    let (r, mut rx) = c.start(0, 1);
    // worker-1 never starts. The first sends are queued while the link
    // still dials; when the dial fails they are handed back, not lost.
    let mut queued = Vec::new();
    for req in 1..=3 {
        if r.send(1, req, submit(req)).is_ok() {
            queued.push(req);
        }
    }
    assert_eq!(queued, [1, 2, 3], "the link was not dialing yet");
    let mut back = Vec::new();
    while back.len() < queued.len() {
        match next(&mut rx).await {
            Inbound::Undelivered {
                to: 1,
                msg: Message::Submit(s),
                reason: SendFailure::PeerGone,
            } => back.push(s.req),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(back, queued);
    assert_eq!(r.stats().undelivered, 3);
}

#[tokio::test]
async fn a_bulk_transfer_arrives_whole_beside_control_messages() {
    let c = Cluster::new(&[("worker-1", Role::Prefill), ("worker-2", Role::Decode)]);
    let (p, _prx) = c.start(0, 1);
    let (_d, mut drx) = c.start(1, 1);
    send_when_up(&p, 1, 0, Message::Heartbeat(EngineStatus::default())).await;
    assert!(matches!(next(&mut drx).await, Inbound::Message { .. }));
    let data: Vec<u8> = (0..8u32 << 20).map(|i| (i * 7 + i / 251) as u8).collect();
    let header = kv_header(42, data.len());
    let send = p.send_bulk(1, header.clone(), Bytes::from(data.clone()));
    let pings = async {
        for i in 0..20 {
            p.send(
                1,
                i,
                Message::Ping {
                    seq: i,
                    pad: vec![],
                },
            )
            .unwrap();
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    let (res, ()) = tokio::join!(send, pings);
    res.unwrap();
    let (mut pings_seen, mut bulk) = (0, None);
    while bulk.is_none() || pings_seen < 20 {
        match next(&mut drx).await {
            Inbound::Message {
                msg: Message::Ping { seq, .. },
                ..
            } => {
                assert_eq!(seq, pings_seen, "pings out of order");
                pings_seen += 1;
            }
            Inbound::Bulk {
                header: h, data: d, ..
            } => bulk = Some((h, d)),
            other => panic!("unexpected {other:?}"),
        }
    }
    let (h, d) = bulk.unwrap();
    assert_eq!(h, header);
    assert!(d.concat() == data, "bulk bytes differ");
}

fn kv_header(req: u64, bytes: usize) -> KvTransferHeader {
    KvTransferHeader {
        router: 0,
        req,
        epoch: 1,
        model: "m".into(),
        block_size: 16,
        dtype: flotilla_proto::KvDtype::F16,
        layout: 1,
        layer_start: 0,
        layer_end: 30,
        token_count: 16,
        block_count: 1,
        bytes: bytes as u64,
        checksum: 0,
        first: Sampled {
            token: 0,
            logprob: 0.0,
            top: vec![],
        },
    }
}

/// Waits for the next bulk transfer, skipping control messages.
async fn next_bulk(rx: &mut mpsc::UnboundedReceiver<Inbound>) -> (KvTransferHeader, Vec<u8>) {
    loop {
        if let Inbound::Bulk { header, data, .. } = next(rx).await {
            return (header, data.concat());
        }
    }
}

#[tokio::test]
async fn transfers_go_to_the_peer_s_bulk_endpoint_which_the_link_learns_again_after_a_restart() {
    let c = Cluster::new(&[("worker-1", Role::Prefill), ("worker-2", Role::Decode)]);
    let (p, _prx) = c.start(0, 1);
    // The decode node's bulk endpoint on a port of its config's choosing.
    let mut opts = c.opts(1, 1);
    opts.bulk_port = free_port();
    let m = TlsMaterial::load(c.certs(), "worker-2").unwrap();
    let (d, mut drx) = QuicTransport::start_channel(opts.clone(), &m).unwrap();
    assert_eq!(d.bulk_addr().unwrap().port(), opts.bulk_port);
    assert_ne!(d.bulk_addr().unwrap(), d.local_addr().unwrap());
    send_when_up(&p, 1, 0, Message::Heartbeat(EngineStatus::default())).await;
    let data = Bytes::from(vec![5u8; 1 << 20]);
    p.send_bulk(1, kv_header(1, data.len()), data.clone())
        .await
        .unwrap();
    let (h, got) = next_bulk(&mut drx).await;
    assert_eq!((h.req, got.len()), (1, data.len()));

    // The node restarts on the same control port; its bulk endpoint now
    // has any free port, which the prefill node learns when it redials.
    drop(d);
    drop(drx);
    let mut opts2 = c.opts(1, 2);
    opts2.bulk_port = 0;
    let mut restarted = None;
    for _ in 0..200 {
        match QuicTransport::start_channel(opts2.clone(), &m) {
            Ok(t) => {
                restarted = Some(t);
                break;
            }
            // The old socket closes once its driver has finished.
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
    let (d2, mut d2rx) = restarted.expect("the restarted node binds its port");
    assert_ne!(d2.bulk_addr().unwrap().port(), opts.bulk_port);
    let mut sent = false;
    for _ in 0..300 {
        if p.is_connected(1)
            && p.send_bulk(1, kv_header(2, data.len()), data.clone())
                .await
                .is_ok()
        {
            sent = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(sent, "no transfer reached the restarted node");
    let (h, got) = next_bulk(&mut d2rx).await;
    assert_eq!((h.req, got), (2, data.to_vec()));
}

#[tokio::test]
async fn the_delay_hook_fires_on_outgoing_frames() {
    let c = Cluster::new(&[("router", Role::Router), ("worker-1", Role::Worker)]);
    let mut opts = c.opts(0, 1);
    opts.faults = LinkFaults {
        delay: Duration::from_millis(40),
        loss_one_in: 2,
    };
    let m = TlsMaterial::load(c.certs(), "router").unwrap();
    let (r, _rrx) = QuicTransport::start_channel(opts, &m).unwrap();
    let (_w, mut wrx) = c.start(1, 1);
    send_when_up(&r, 1, 0, Message::Heartbeat(EngineStatus::default())).await;
    next(&mut wrx).await;
    // Frames 2 and 3: one plain delay, one "lost" (four times the delay).
    let mut took = Vec::new();
    for i in 1..=2u64 {
        let t0 = std::time::Instant::now();
        r.send(
            1,
            i,
            Message::Ping {
                seq: i,
                pad: vec![],
            },
        )
        .unwrap();
        next(&mut wrx).await;
        took.push(t0.elapsed());
    }
    took.sort();
    assert!(took[0] >= Duration::from_millis(40), "no delay: {took:?}");
    assert!(
        took[1] >= Duration::from_millis(160),
        "no loss-like delay: {took:?}"
    );
}

#[tokio::test]
async fn a_peer_that_dials_in_cuts_the_redial_backoff_short() {
    let c = Cluster::new(&[("router", Role::Router), ("worker-1", Role::Worker)]);
    let mut opts = c.opts(0, 1);
    opts.reconnect_backoff_max = Duration::from_secs(60);
    opts.connect_timeout = Duration::from_millis(50);
    let m = TlsMaterial::load(c.certs(), "router").unwrap();
    let (r, _rrx) = QuicTransport::start_channel(opts, &m).unwrap();
    // worker-1 is absent long enough for the router's backoff to grow to
    // seconds: dials of 50 ms with sleeps of 20 ms doubling put it in a
    // sleep from about 2.9 s to 5.5 s.
    let waited = Instant::now();
    while waited.elapsed() < Duration::from_millis(3500) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!r.is_reachable(1), "a link to an absent peer is down");
    // worker-1 starts and dials the router; the router's link follows at
    // once instead of at the end of a multi-second backoff.
    let (_w, mut wrx) = c.start(1, 1);
    let up = Instant::now();
    while !r.is_connected(1) {
        assert!(
            up.elapsed() < Duration::from_millis(1000),
            "the router's link waited out its backoff"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(r.is_reachable(1));
    r.send(1, 4, submit(4)).unwrap();
    assert!(matches!(
        next(&mut wrx).await,
        Inbound::Message { correlation: 4, .. }
    ));
}
