//! A pipeline group's links over QUIC: stage 0 dials each later stage
//! (mutual TLS under the cluster CA, as every node link) and keeps one
//! bidirectional stream open to it, on which it sends a frame
//! ([`flotilla_proto::stage`]) and reads the answer, one at a time.
//!
//! [`QuicStageLink`] is stage 0's end: a [`StageLink`] whose calls block
//! (the executor's step is synchronous) while a thread of its own drives
//! the connection. [`serve_stage`] is a stage's end: it accepts stage 0
//! (only the node named as the group's stage 0), reads frames, and hands
//! each to the stage's handler on a blocking thread. A newer connection
//! replaces an older one (stage 0 started again). A lost peer is seen
//! within the idle timeout (keep-alives every quarter of it).

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use flotilla_proto::stage::{
    FromStage, StageLink, ToStage, decode_from_stage, decode_to_stage, encode, frame_len,
};
use quinn::{Endpoint, RecvStream, SendStream};

use crate::tls::{self, TlsMaterial};

/// How a stage link behaves.
#[derive(Clone, Debug)]
pub struct StageLinkOptions {
    /// A peer silent this long is lost.
    pub idle_timeout: Duration,
    /// How long dialing may take.
    pub connect_timeout: Duration,
    /// Added before each request is sent (a test hook: the round-trip
    /// time of a longer link; the kernel here has no netem).
    pub delay: Duration,
    /// Longest wait for a step's or a block operation's answer: a stage
    /// that keeps its connection alive but never answers is lost after
    /// it (a hello, which may load the stage's layers, waits ten times
    /// as long).
    pub call_timeout: Duration,
}

impl Default for StageLinkOptions {
    fn default() -> Self {
        StageLinkOptions {
            idle_timeout: Duration::from_secs(3),
            connect_timeout: Duration::from_secs(5),
            delay: Duration::ZERO,
            call_timeout: Duration::from_secs(120),
        }
    }
}

fn transport(idle: Duration) -> Result<Arc<quinn::TransportConfig>, String> {
    let mut tc = quinn::TransportConfig::default();
    tc.keep_alive_interval(Some(idle / 4));
    tc.max_idle_timeout(Some(
        quinn::IdleTimeout::try_from(idle).map_err(|_| "idle timeout out of range".to_string())?,
    ));
    // A step's rows in one flight where the path allows.
    tc.stream_receive_window(quinn::VarInt::from_u32(64 << 20));
    tc.receive_window(quinn::VarInt::from_u32(128 << 20));
    tc.send_window(128 << 20);
    Ok(Arc::new(tc))
}

type Reply = mpsc::SyncSender<Result<Vec<u8>, String>>;

/// Stage 0's end of one stage link.
pub struct QuicStageLink {
    to: tokio::sync::mpsc::UnboundedSender<(Vec<u8>, Reply)>,
    peer: String,
    call_timeout: Duration,
    /// Set once the link failed: every later call fails at once.
    lost: Option<String>,
    /// The driver thread; it ends when `to` is dropped.
    _thread: std::thread::JoinHandle<()>,
}

async fn write_frame(s: &mut SendStream, frame: &[u8]) -> Result<(), String> {
    s.write_all(frame).await.map_err(|e| e.to_string())
}

async fn read_frame(r: &mut RecvStream) -> Result<Option<Vec<u8>>, String> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(()) => {}
        Err(quinn::ReadExactError::FinishedEarly(0)) => return Ok(None),
        Err(e) => return Err(e.to_string()),
    }
    let n = frame_len(len).map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; n];
    r.read_exact(&mut buf).await.map_err(|e| e.to_string())?;
    Ok(Some(buf))
}

impl QuicStageLink {
    /// Dials the stage at `addr` (`host:port`), which must present the
    /// certificate of node `name`, and opens the link's stream.
    pub fn connect(
        addr: &str,
        name: &str,
        tls: &TlsMaterial,
        opts: &StageLinkOptions,
    ) -> Result<QuicStageLink, String> {
        let to_addr: SocketAddr = addr
            .to_socket_addrs()
            .map_err(|e| format!("stage {name} at {addr}: {e}"))?
            .next()
            .ok_or_else(|| format!("stage {name} at {addr}: no address"))?;
        let client =
            tls::client_config(tls, transport(opts.idle_timeout)?).map_err(|e| e.to_string())?;
        // The driver awaits requests (a blocking wait would starve the
        // connection's keep-alives).
        let (to, mut from) = tokio::sync::mpsc::unbounded_channel::<(Vec<u8>, Reply)>();
        let (ready_tx, ready_rx) = mpsc::sync_channel::<Result<(), String>>(1);
        let (server, delay, timeout) = (name.to_string(), opts.delay, opts.connect_timeout);
        let thread = std::thread::Builder::new()
            .name(format!("stage-link-{name}"))
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.to_string()));
                        return;
                    }
                };
                rt.block_on(async move {
                    let bind: SocketAddr = if to_addr.is_ipv6() {
                        "[::]:0".parse().expect("an address")
                    } else {
                        "0.0.0.0:0".parse().expect("an address")
                    };
                    let opened = async {
                        let mut ep = Endpoint::client(bind).map_err(|e| e.to_string())?;
                        ep.set_default_client_config(client);
                        let conn = ep
                            .connect(to_addr, &server)
                            .map_err(|e| e.to_string())?
                            .await
                            .map_err(|e| e.to_string())?;
                        let (s, r) = conn.open_bi().await.map_err(|e| e.to_string())?;
                        Ok::<_, String>((ep, conn, s, r))
                    };
                    let (_ep, conn, mut s, mut r) =
                        match tokio::time::timeout(timeout, opened).await {
                            Ok(Ok(x)) => x,
                            Ok(Err(e)) => {
                                let _ = ready_tx.send(Err(e));
                                return;
                            }
                            Err(_) => {
                                let _ = ready_tx.send(Err(format!("no answer in {timeout:?}")));
                                return;
                            }
                        };
                    let _ = ready_tx.send(Ok(()));
                    // One request at a time, each answered before the next.
                    while let Some((frame, reply)) = from.recv().await {
                        if !delay.is_zero() {
                            tokio::time::sleep(delay).await;
                        }
                        let answer = async {
                            write_frame(&mut s, &frame).await?;
                            read_frame(&mut r)
                                .await?
                                .ok_or_else(|| "the stage closed the link".to_string())
                        }
                        .await;
                        let failed = answer.is_err();
                        let _ = reply.send(answer);
                        if failed {
                            break;
                        }
                    }
                    conn.close(0u32.into(), b"done");
                });
            })
            .map_err(|e| e.to_string())?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(QuicStageLink {
                to,
                peer: format!("{name} at {addr}"),
                call_timeout: opts.call_timeout,
                lost: None,
                _thread: thread,
            }),
            Ok(Err(e)) => Err(format!("stage {name} at {addr}: {e}")),
            Err(_) => Err(format!("stage {name} at {addr}: the link's thread ended")),
        }
    }
}

impl StageLink for QuicStageLink {
    fn call(&mut self, msg: &ToStage) -> Result<FromStage, String> {
        if let Some(why) = &self.lost {
            return Err(why.clone());
        }
        // Refused here, nothing sent: the link stays as it is.
        let frame = encode(msg).map_err(|e| format!("{}: {e}", self.peer))?;
        let (tx, rx) = mpsc::sync_channel(1);
        let limit = match msg {
            ToStage::Hello(_) => self.call_timeout * 10,
            _ => self.call_timeout,
        };
        let answer = self
            .to
            .send((frame, tx))
            .map_err(|_| "the link's thread ended".to_string())
            .and_then(|()| {
                rx.recv_timeout(limit).map_err(|e| match e {
                    mpsc::RecvTimeoutError::Timeout => format!("no answer in {limit:?}"),
                    mpsc::RecvTimeoutError::Disconnected => "the link's thread ended".to_string(),
                })
            })
            .and_then(|r| r)
            .and_then(|payload| decode_from_stage(&payload).map_err(|e| e.to_string()));
        if let Err(e) = &answer {
            self.lost = Some(format!("{}: {e}", self.peer));
            return Err(self.lost.clone().expect("set above"));
        }
        answer
    }
}

/// What a stage does with each frame (run on a blocking thread).
pub type StageHandler = Arc<Mutex<dyn FnMut(ToStage) -> FromStage + Send>>;

/// A stage's end: listens on `listen`, accepts the node named `stage0`
/// (its certificate, under the cluster CA) and answers its frames with
/// `handler` until the endpoint closes. Runs inside a tokio runtime;
/// returns when the endpoint can no longer accept.
pub async fn serve_stage(
    listen: SocketAddr,
    tls: &TlsMaterial,
    stage0: String,
    idle_timeout: Duration,
    handler: StageHandler,
) -> Result<(), String> {
    let server = tls::server_config(tls, transport(idle_timeout)?).map_err(|e| e.to_string())?;
    let ep = Endpoint::server(server, listen).map_err(|e| format!("listen {listen}: {e}"))?;
    serve_on(ep, stage0, handler).await
}

/// [`serve_stage`] on an endpoint already bound (tests bind port 0 and
/// read the address).
pub async fn serve_on(ep: Endpoint, stage0: String, handler: StageHandler) -> Result<(), String> {
    let current: Arc<Mutex<Option<quinn::Connection>>> = Arc::default();
    while let Some(incoming) = ep.accept().await {
        let (handler, stage0, current) = (handler.clone(), stage0.clone(), current.clone());
        tokio::spawn(async move {
            let conn = match incoming.await {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "stage link: a connection failed");
                    return;
                }
            };
            match tls::peer_identity(&conn) {
                Ok(id) if id.name == stage0 => {}
                Ok(id) => {
                    tracing::warn!(peer = %id.name, expected = %stage0, "stage link: refused a node that is not this group's stage 0");
                    conn.close(1u32.into(), b"not this group's stage 0");
                    return;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "stage link: no identity");
                    conn.close(1u32.into(), b"no identity");
                    return;
                }
            }
            // The newest stage 0 wins: an older link is from its last life.
            if let Some(old) = current
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .replace(conn.clone())
            {
                old.close(2u32.into(), b"replaced");
            }
            tracing::info!(peer = %stage0, "stage link up");
            let Ok((mut s, mut r)) = conn.accept_bi().await else {
                return;
            };
            loop {
                let payload = match read_frame(&mut r).await {
                    Ok(Some(p)) => p,
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(error = %e, "stage link: read");
                        break;
                    }
                };
                let answer = match decode_to_stage(&payload) {
                    Ok(msg) => {
                        let h = handler.clone();
                        match tokio::task::spawn_blocking(move || {
                            (h.lock().unwrap_or_else(|e| e.into_inner()))(msg)
                        })
                        .await
                        {
                            Ok(a) => a,
                            Err(e) => FromStage::Refused {
                                reason: format!("the stage failed: {e}"),
                            },
                        }
                    }
                    Err(e) => FromStage::Refused {
                        reason: format!("a bad frame: {e}"),
                    },
                };
                let frame = match encode(&answer) {
                    Ok(f) => f,
                    Err(e) => match encode(&FromStage::Refused {
                        reason: format!("the answer does not fit a frame: {e}"),
                    }) {
                        Ok(f) => f,
                        Err(_) => break,
                    },
                };
                if write_frame(&mut s, &frame).await.is_err() {
                    break;
                }
            }
            tracing::info!(peer = %stage0, "stage link down");
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_proto::Role;
    use flotilla_proto::stage::StageSeq;

    fn certs() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        tls::init_ca(dir.path()).unwrap();
        for n in ["s0", "s1", "other"] {
            tls::issue(dir.path(), n, Role::Worker).unwrap();
        }
        dir
    }

    /// A stage that answers a step with its rows reversed.
    fn handler() -> StageHandler {
        Arc::new(Mutex::new(|m: ToStage| match m {
            ToStage::Step { step, mut rows, .. } => {
                rows.reverse();
                FromStage::Rows { step, rows }
            }
            _ => FromStage::Done,
        }))
    }

    fn step(n: u64) -> ToStage {
        ToStage::Step {
            step: n,
            seqs: vec![StageSeq::default()],
            dtype: flotilla_proto::stage::ActDtype::F16,
            rows: (0..=255u8).cycle().take(3 << 20).collect(),
            last: false,
        }
    }

    #[test]
    fn stage_zero_calls_a_stage_over_quic_and_others_are_refused() {
        let dir = certs();
        let rt = tokio::runtime::Runtime::new().unwrap();
        let s1 = TlsMaterial::load(dir.path(), "s1").unwrap();
        let server = tls::server_config(&s1, transport(Duration::from_secs(3)).unwrap()).unwrap();
        let ep = rt
            .block_on(async { Endpoint::server(server, "127.0.0.1:0".parse().unwrap()).unwrap() });
        let addr = ep.local_addr().unwrap().to_string();
        let served = rt.spawn(serve_on(ep.clone(), "s0".into(), handler()));
        let s0 = TlsMaterial::load(dir.path(), "s0").unwrap();
        let opts = StageLinkOptions {
            delay: Duration::from_millis(20),
            ..Default::default()
        };
        let mut link = QuicStageLink::connect(&addr, "s1", &s0, &opts).unwrap();
        for n in 1..4 {
            let t = std::time::Instant::now();
            match link.call(&step(n)).unwrap() {
                FromStage::Rows { step, rows } => {
                    assert_eq!(step, n);
                    assert_eq!(rows.len(), 3 << 20);
                    assert_eq!(rows[0], ((3usize << 20) - 1) as u8);
                }
                o => panic!("{o:?}"),
            }
            // The delay hook fired.
            assert!(t.elapsed() >= Duration::from_millis(20));
        }
        // Another node of the cluster is not this group's stage 0: its
        // link opens (TLS is fine) but its first call fails.
        let other = TlsMaterial::load(dir.path(), "other").unwrap();
        let refused = QuicStageLink::connect(&addr, "s1", &other, &Default::default())
            .and_then(|mut l| l.call(&step(1)));
        assert!(refused.is_err(), "{refused:?}");
        // The wrong server name is refused by TLS.
        assert!(QuicStageLink::connect(&addr, "s0", &s0, &Default::default()).is_err());
        // The stage goes away: the next call fails, and every later one.
        ep.close(0u32.into(), b"bye");
        rt.block_on(async { served.await.unwrap().unwrap() });
        let t = std::time::Instant::now();
        let e = link.call(&step(9)).unwrap_err();
        assert!(e.contains("s1"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(10));
        assert!(link.call(&step(10)).is_err());
    }

    /// A stage that keeps its connection but never answers is lost after
    /// the call timeout.
    #[test]
    fn a_stage_that_does_not_answer_is_lost_after_the_call_timeout() {
        let dir = certs();
        let rt = tokio::runtime::Runtime::new().unwrap();
        let s1 = TlsMaterial::load(dir.path(), "s1").unwrap();
        let server = tls::server_config(&s1, transport(Duration::from_secs(3)).unwrap()).unwrap();
        let ep = rt
            .block_on(async { Endpoint::server(server, "127.0.0.1:0".parse().unwrap()).unwrap() });
        let addr = ep.local_addr().unwrap().to_string();
        let slow: StageHandler = Arc::new(Mutex::new(|_m: ToStage| {
            std::thread::sleep(Duration::from_secs(2));
            FromStage::Done
        }));
        rt.spawn(serve_on(ep.clone(), "s0".into(), slow));
        let s0 = TlsMaterial::load(dir.path(), "s0").unwrap();
        let opts = StageLinkOptions {
            call_timeout: Duration::from_millis(300),
            ..Default::default()
        };
        let mut link = QuicStageLink::connect(&addr, "s1", &s0, &opts).unwrap();
        let t = std::time::Instant::now();
        let e = link
            .call(&ToStage::CopyBlock { src: 0, dst: 1 })
            .unwrap_err();
        assert!(e.contains("no answer"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        assert!(link.call(&ToStage::CopyBlock { src: 0, dst: 1 }).is_err());
        ep.close(0u32.into(), b"bye");
    }
}
