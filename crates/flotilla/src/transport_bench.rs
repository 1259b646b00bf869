//! `flotilla bench-transport`: two QUIC transports on loopback, each on its
//! own single-threaded runtime: small-message round trips, small-message
//! throughput, one bulk transfer, and round trips while the bulk transfer
//! runs; plain TCP on the same loopback moves the same bytes as the
//! baseline.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use bytes::Bytes;
use flotilla_proto::Role;
use flotilla_proto::Sampled;
use flotilla_proto::wire::{KvTransferHeader, Message};
use flotilla_transport::quic::{LinkFaults, PeerSpec, QuicOptions, QuicTransport};
use flotilla_transport::tls::{self, TlsMaterial};
use flotilla_transport::{Inbound, SendFailure, Transport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

/// `flotilla bench-transport` flags.
#[derive(clap::Args, Clone)]
pub struct TransportBenchArgs {
    /// Round trips measured (idle and under bulk load).
    #[arg(long, default_value_t = 5000)]
    pub round_trips: usize,
    /// Payload of a small message, bytes.
    #[arg(long, default_value_t = 256)]
    pub message_bytes: usize,
    /// Messages in the throughput test.
    #[arg(long, default_value_t = 200_000)]
    pub messages: usize,
    /// Size of the bulk transfer, MiB.
    #[arg(long, default_value_t = 64)]
    pub bulk_mib: usize,
    /// Round trips measured while transfers run: the transfer is repeated
    /// back to back until there are this many (at most 64 transfers).
    #[arg(long, default_value_t = 300)]
    pub under_bulk_samples: usize,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// Transfers timed back to back for the bulk figure.
const BULK_ALONE_TRANSFERS: usize = 4;

fn free_udp_port() -> Result<u16> {
    Ok(std::net::UdpSocket::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// One side's runtime on its own thread; `f` runs on it.
fn side<T: Send + 'static>(
    name: &str,
    f: impl std::future::Future<Output = T> + Send + 'static,
) -> std::thread::JoinHandle<T> {
    let name = name.to_string();
    std::thread::Builder::new()
        .name(name)
        .spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime")
                .block_on(f)
        })
        .expect("thread")
}

pub fn run(args: &TransportBenchArgs) -> Result<()> {
    let dir = std::env::temp_dir().join(format!("flotilla-bench-transport-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    tls::init_ca(&dir)?;
    tls::issue(&dir, "sender", Role::Prefill)?;
    tls::issue(&dir, "receiver", Role::Decode)?;
    let nodes = vec![
        PeerSpec {
            name: "sender".into(),
            role: Role::Prefill,
            addr: format!("127.0.0.1:{}", free_udp_port()?),
        },
        PeerSpec {
            name: "receiver".into(),
            role: Role::Decode,
            addr: format!("127.0.0.1:{}", free_udp_port()?),
        },
    ];
    let opts = |node: u32| QuicOptions {
        node,
        nodes: nodes.clone(),
        listen: nodes[node as usize]
            .addr
            .parse::<SocketAddr>()
            .expect("addr"),
        bulk_port: 0,
        epoch: 1,
        frame_len_max_bytes: 1 << 20,
        send_queue_len_max: 4096,
        bulk_len_max_bytes: 1 << 32,
        keep_alive: Duration::from_millis(500),
        idle_timeout: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(2),
        reconnect_backoff_max: Duration::from_millis(200),
        faults: LinkFaults::default(),
        joining: None,
        join: flotilla_transport::members::JoinPolicy::default(),
    };
    let recv_certs = TlsMaterial::load(&dir, "receiver")?;
    let send_certs = TlsMaterial::load(&dir, "sender")?;
    let ropts = opts(1);
    let sopts = opts(0);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    // The receiver echoes pings and counts what arrives.
    let receiver = side("receiver", async move {
        let (t, rx) = QuicTransport::start_channel(ropts, &recv_certs).expect("receiver starts");
        echo(t, rx, stop_rx).await
    });
    let a = args.clone();
    let sender = side("sender", async move {
        let (t, rx) = QuicTransport::start_channel(sopts, &send_certs).expect("sender starts");
        measure(t, rx, &a).await
    });
    let report = sender.join().expect("sender thread")?;
    let _ = stop_tx.send(());
    let _ = receiver.join();
    let _ = std::fs::remove_dir_all(&dir);

    let tcp_gbps = tcp_baseline(args.bulk_mib << 20)?;
    let under_ratio = report.rtt_bulk_p99_us / report.rtt_idle_p99_us;
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "rtt_idle_p50_us": report.rtt_idle_p50_us, "rtt_idle_p99_us": report.rtt_idle_p99_us,
                "messages_per_s": report.msgs_per_s, "message_bytes": args.message_bytes,
                "bulk_bytes": args.bulk_mib << 20, "bulk_gb_per_s": report.bulk_gbps,
                "tcp_gb_per_s": tcp_gbps,
                "rtt_under_bulk_p50_us": report.rtt_bulk_p50_us,
                "rtt_under_bulk_p99_us": report.rtt_bulk_p99_us,
                "rtt_under_bulk_samples": report.bulk_samples,
                "transfers_under_pings": report.transfers,
                "bulk_under_pings_gb_per_s": report.bulk_under_gbps,
                "under_bulk_p99_ratio": under_ratio,
                "mtu_control": report.mtu.0, "mtu_bulk": report.mtu.1,
            })
        );
    } else {
        println!("QUIC (quinn, mutual TLS) between two nodes on loopback, one thread per side");
        println!(
            "path MTU: control connection {:?}, bulk connection {:?}",
            report.mtu.0, report.mtu.1
        );
        println!(
            "small-message round trip ({} B):  p50 {:.1} us  p99 {:.1} us  ({} samples)",
            args.message_bytes, report.rtt_idle_p50_us, report.rtt_idle_p99_us, args.round_trips
        );
        println!(
            "small-message throughput ({} B): {:.0} messages/s ({:.1} MB/s)",
            args.message_bytes,
            report.msgs_per_s,
            report.msgs_per_s * args.message_bytes as f64 / 1e6
        );
        println!(
            "bulk, {BULK_ALONE_TRANSFERS} transfers of {} MiB: {:.2} GB/s   (plain TCP on loopback, same bytes: {:.2} GB/s, QUIC/TCP {:.2}x)",
            args.bulk_mib,
            report.bulk_gbps,
            tcp_gbps,
            report.bulk_gbps / tcp_gbps
        );
        println!(
            "round trip while transfers run: p50 {:.1} us  p99 {:.1} us  ({} samples over {} transfers at {:.2} GB/s); p99 {:.2}x idle",
            report.rtt_bulk_p50_us,
            report.rtt_bulk_p99_us,
            report.bulk_samples,
            report.transfers,
            report.bulk_under_gbps,
            under_ratio
        );
    }
    Ok(())
}

async fn echo(
    t: Arc<QuicTransport>,
    mut rx: mpsc::UnboundedReceiver<Inbound>,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    loop {
        tokio::select! {
            m = rx.recv() => match m {
                Some(Inbound::Message { from, msg: Message::Ping { seq, pad }, .. }) => {
                    // Throughput pings (seq with the top bit) are counted, not echoed.
                    if seq >> 63 == 0 {
                        let _ = t.send(from, seq, Message::Pong { seq, pad });
                    } else if seq & 0xffff_ffff == 0 {
                        let _ = t.send(from, seq, Message::Pong { seq, pad: vec![] });
                    }
                }
                Some(Inbound::Bulk { from, header, .. }) => {
                    let _ = t.send(from, header.req, Message::Pong { seq: u64::MAX, pad: vec![] });
                }
                Some(_) => {}
                None => return,
            },
            _ = &mut stop => return,
        }
    }
}

struct Report {
    rtt_idle_p50_us: f64,
    rtt_idle_p99_us: f64,
    msgs_per_s: f64,
    bulk_gbps: f64,
    rtt_bulk_p50_us: f64,
    rtt_bulk_p99_us: f64,
    bulk_samples: usize,
    bulk_under_gbps: f64,
    transfers: usize,
    mtu: (Option<u16>, Option<u16>),
}

async fn send_retrying(t: &QuicTransport, seq: u64, pad: Vec<u8>) -> Result<()> {
    let mut msg = Message::Ping { seq, pad };
    loop {
        match t.send(1, seq, msg) {
            Ok(()) => return Ok(()),
            Err(e) if matches!(e.reason, SendFailure::QueueFull(_)) => {
                msg = *e.msg;
                tokio::task::yield_now().await;
            }
            Err(e) if !t.is_connected(1) => {
                msg = *e.msg;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

async fn pong(rx: &mut mpsc::UnboundedReceiver<Inbound>) -> Result<u64> {
    loop {
        let m = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .context("no answer within 10 s")?
            .context("transport closed")?;
        if let Inbound::Message {
            msg: Message::Pong { seq, .. },
            ..
        } = m
        {
            return Ok(seq);
        }
    }
}

async fn measure(
    t: Arc<QuicTransport>,
    mut rx: mpsc::UnboundedReceiver<Inbound>,
    args: &TransportBenchArgs,
) -> Result<Report> {
    let pad = vec![7u8; args.message_bytes];
    // Warm up: connect, and let MTU discovery settle.
    for i in 0..200 {
        send_retrying(&t, i, pad.clone()).await?;
        pong(&mut rx).await?;
    }
    // One transfer of the full size first, so both sides' buffers are
    // allocated and faulted in before anything is timed.
    let data = Bytes::from(vec![3u8; args.bulk_mib << 20]);
    run_bulk(&t, &mut rx, data.clone()).await?;

    let mut idle = Vec::with_capacity(args.round_trips);
    for i in 0..args.round_trips as u64 {
        let t0 = Instant::now();
        send_retrying(&t, i, pad.clone()).await?;
        let seq = pong(&mut rx).await?;
        anyhow::ensure!(seq == i, "pong {seq} for ping {i}");
        idle.push(t0.elapsed().as_secs_f64() * 1e6);
    }

    // Throughput: the receiver answers only the last one.
    let n = args.messages as u64;
    let t0 = Instant::now();
    for i in 1..=n {
        let seq = (1u64 << 63) | if i == n { 0 } else { i };
        send_retrying(&t, seq, pad.clone()).await?;
    }
    pong(&mut rx).await?;
    let msgs_per_s = n as f64 / t0.elapsed().as_secs_f64();

    // Bulk alone: transfers back to back, each acknowledged by the receiver
    // before the next starts.
    let t0 = Instant::now();
    for _ in 0..BULK_ALONE_TRANSFERS {
        run_bulk(&t, &mut rx, data.clone()).await?;
    }
    let bulk_gbps = (data.len() * BULK_ALONE_TRANSFERS) as f64 / t0.elapsed().as_secs_f64() / 1e9;
    let mtu = t.path_mtu(1);

    // Round trips while the same transfer runs again, back to back, until
    // there are enough samples for a p99 (one transfer lasts tens of ms).
    let mut under = Vec::new();
    let mut i = 1u64 << 40;
    let (mut under_bytes, mut transfers) = (0usize, 0usize);
    let t_under = Instant::now();
    while under.len() < args.under_bulk_samples.min(args.round_trips) && transfers < 64 {
        let bulk = {
            let t = t.clone();
            let data = data.clone();
            tokio::spawn(async move {
                let header = header(data.len() as u64);
                t.send_bulk(1, header, data).await
            })
        };
        let mut acked = false;
        while !bulk.is_finished() {
            let t0 = Instant::now();
            send_retrying(&t, i, pad.clone()).await?;
            loop {
                let s = pong(&mut rx).await?;
                acked |= s == u64::MAX;
                if s == i {
                    break;
                }
            }
            under.push(t0.elapsed().as_secs_f64() * 1e6);
            i += 1;
            tokio::time::sleep(Duration::from_micros(500)).await;
        }
        bulk.await?
            .map_err(|e| anyhow::anyhow!("bulk transfer: {e}"))?;
        // The receiver's ack of the transfer.
        while !acked {
            acked = pong(&mut rx).await? == u64::MAX;
        }
        under_bytes += data.len();
        transfers += 1;
    }
    let bulk_under_gbps = under_bytes as f64 / t_under.elapsed().as_secs_f64() / 1e9;
    let bulk_samples = under.len();
    Ok(Report {
        rtt_idle_p50_us: pct(&mut idle, 0.5),
        rtt_idle_p99_us: pct(&mut idle, 0.99),
        msgs_per_s,
        bulk_gbps,
        rtt_bulk_p50_us: pct(&mut under, 0.5),
        rtt_bulk_p99_us: pct(&mut under, 0.99),
        bulk_samples,
        bulk_under_gbps,
        transfers,
        mtu,
    })
}

fn header(bytes: u64) -> KvTransferHeader {
    KvTransferHeader {
        router: 0,
        req: 1,
        epoch: 1,
        model: "bench".into(),
        block_size: 16,
        dtype: flotilla_proto::KvDtype::F16,
        layout: 1,
        layer_start: 0,
        layer_end: 30,
        token_count: 0,
        block_count: 0,
        bytes,
        checksum: 0,
        first: Sampled {
            token: 0,
            logprob: 0.0,
            top: vec![],
        },
    }
}

async fn run_bulk(
    t: &QuicTransport,
    rx: &mut mpsc::UnboundedReceiver<Inbound>,
    data: Bytes,
) -> Result<()> {
    t.send_bulk(1, header(data.len() as u64), data)
        .await
        .map_err(|e| anyhow::anyhow!("bulk transfer: {e}"))?;
    // The receiver confirms it has the whole transfer.
    while pong(rx).await? != u64::MAX {}
    Ok(())
}

/// The same bytes over plain TCP on loopback, one thread per side.
fn tcp_baseline(bytes: usize) -> Result<f64> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    listener.set_nonblocking(true)?;
    let recv = side("tcp-receiver", async move {
        let l = tokio::net::TcpListener::from_std(listener).expect("listener");
        let (mut s, _) = l.accept().await.expect("accept");
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0usize;
        while got < bytes {
            let n = s.read(&mut buf).await.expect("read");
            if n == 0 {
                break;
            }
            got += n;
        }
        s.write_all(b"k").await.expect("ack");
    });
    let send = side("tcp-sender", async move {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let data = vec![3u8; 1 << 20];
        let t0 = Instant::now();
        let mut sent = 0;
        while sent < bytes {
            let n = (bytes - sent).min(data.len());
            s.write_all(&data[..n]).await.expect("write");
            sent += n;
        }
        let mut ack = [0u8; 1];
        s.read_exact(&mut ack).await.expect("ack");
        bytes as f64 / t0.elapsed().as_secs_f64() / 1e9
    });
    let gbps = send
        .join()
        .map_err(|_| anyhow::anyhow!("tcp sender panicked"))?;
    let _ = recv.join();
    Ok(gbps)
}
