//! The engine node's side: requests that arrive over the transport are
//! submitted to the node's own engine (the same Scheduler, KvBlockPool and
//! GpuWorker actors `flotilla serve` runs), and their events go back to
//! the Router coalesced: everything one step produced for one Router
//! leaves in one frame.
//!
//! Every request is tied to the Router that sent it and that Router's
//! epoch. When the Router goes silent past the down-after bound, or comes
//! back with a new epoch, its requests are cancelled here, which gives
//! their KV blocks back: a dead Router never strands work on a worker.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use flotilla_proto::wire::{LoadReport, Message, ReqEvents, WireEnd, WireRejection, WireToken};
use flotilla_proto::{Engine, EngineEvent, EngineFailure, RequestStream};
use flotilla_transport::{Inbound, NodeId, Transport};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

/// How an engine node serves remote Routers.
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    /// Router nodes to report load to.
    pub routers: Vec<NodeId>,
    /// Heartbeat period.
    pub heartbeat_interval: Duration,
    /// A Router silent this long is gone: its requests are cancelled.
    pub down_after: Duration,
    /// Tenants in the config; a Submit naming another is refused.
    pub num_tenants: u32,
    /// Cap on one frame's payload; event batches are split below it.
    pub frame_len_max_bytes: u32,
}

/// (router, router epoch, router's request id)
type Key = (NodeId, u64, u64);

struct Out {
    key: Key,
    event: EngineEvent,
}

/// Serves remote Routers until `inbound` closes.
pub async fn run_worker(
    transport: Arc<dyn Transport>,
    mut inbound: mpsc::Receiver<Inbound>,
    engine: Arc<dyn Engine>,
    opts: WorkerOptions,
) {
    let (out_tx, out_rx) = mpsc::unbounded_channel::<Out>();
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<Key>();
    tokio::spawn(send_events(
        transport.clone(),
        out_rx,
        opts.frame_len_max_bytes,
    ));
    let mut active: HashMap<Key, oneshot::Sender<bool>> = HashMap::new();
    let mut routers: HashMap<NodeId, (u64, Instant)> = HashMap::new();
    let mut tick = tokio::time::interval(opts.heartbeat_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            m = inbound.recv() => {
                let Some(m) = m else { return };
                let Inbound::Message { from, epoch, msg, .. } = m else { continue };
                // Any message proves the Router alive; a new epoch means it
                // restarted and everything from its old life is orphaned.
                let entry = routers.entry(from).or_insert((epoch, Instant::now()));
                if epoch > entry.0 {
                    cancel_where(&mut active, |k| k.0 == from && k.1 < epoch);
                    entry.0 = epoch;
                }
                entry.1 = Instant::now();
                match msg {
                    Message::Submit(s) => {
                        let req = s.req;
                        let reply = if s.tenant >= opts.num_tenants {
                            Message::Refused {
                                req,
                                rejection: WireRejection::Invalid(format!(
                                    "unknown tenant {} (the config has {})",
                                    s.tenant, opts.num_tenants
                                )),
                            }
                        } else if active.contains_key(&(from, epoch, req)) {
                            // A duplicate (a resend after a reconnect): the
                            // first copy is running.
                            continue;
                        } else {
                            match engine.submit(s.into_request()).await {
                                Ok(stream) => {
                                    let key = (from, epoch, req);
                                    let (cancel_tx, cancel_rx) = oneshot::channel();
                                    active.insert(key, cancel_tx);
                                    tokio::spawn(forward(key, stream, cancel_rx, out_tx.clone(), done_tx.clone()));
                                    Message::Admitted { req }
                                }
                                Err(r) => Message::Refused { req, rejection: WireRejection::from(&r) },
                            }
                        };
                        if let Err(e) = transport.send(from, req, reply) {
                            tracing::warn!("{e}");
                            // The Router will not hear of it: do not run it.
                            if let Some(c) = active.remove(&(from, epoch, req)) {
                                let _ = c.send(false);
                            }
                        }
                    }
                    Message::Cancel { req, stop_string } => {
                        if let Some(c) = active.remove(&(from, epoch, req)) {
                            let _ = c.send(stop_string);
                        }
                    }
                    Message::Ping { seq, pad } => {
                        let _ = transport.send(from, seq, Message::Pong { seq, pad });
                    }
                    _ => {}
                }
            }
            Some(key) = done_rx.recv() => {
                active.remove(&key);
            }
            _ = tick.tick() => {
                let status = engine.status().await;
                let report = LoadReport::from(&status);
                for &r in &opts.routers {
                    // Unreachable Routers are noticed below, by silence.
                    let _ = transport.send(r, 0, Message::Heartbeat(report.clone()));
                }
                let now = Instant::now();
                let silent: Vec<NodeId> = routers
                    .iter()
                    .filter(|(_, (_, heard))| now.duration_since(*heard) > opts.down_after)
                    .map(|(n, _)| *n)
                    .collect();
                for n in silent {
                    let before = active.len();
                    cancel_where(&mut active, |k| k.0 == n);
                    if before != active.len() {
                        tracing::warn!(router = n, "router silent for over {:?}: cancelled {} requests", opts.down_after, before - active.len());
                    }
                    routers.remove(&n);
                }
            }
        }
    }
}

fn cancel_where(active: &mut HashMap<Key, oneshot::Sender<bool>>, f: impl Fn(&Key) -> bool) {
    let keys: Vec<Key> = active.keys().filter(|k| f(k)).copied().collect();
    for k in keys {
        if let Some(c) = active.remove(&k) {
            let _ = c.send(false);
        }
    }
}

/// Moves one request's events to the sender task until it ends or is
/// cancelled; dropping the stream tells the engine to free it.
async fn forward(
    key: Key,
    mut stream: RequestStream,
    mut cancel: oneshot::Receiver<bool>,
    out: mpsc::UnboundedSender<Out>,
    done: mpsc::UnboundedSender<Key>,
) {
    loop {
        tokio::select! {
            ev = stream.recv() => {
                let event = ev.unwrap_or_else(|| {
                    EngineEvent::Failed(EngineFailure::Internal("the engine dropped the request".into()))
                });
                let terminal = !matches!(event, EngineEvent::Token(_));
                let _ = out.send(Out { key, event });
                if terminal {
                    break;
                }
            }
            c = &mut cancel => {
                if c == Ok(true) {
                    stream.ended_by_stop_string();
                }
                break;
            }
        }
    }
    drop(stream);
    let _ = done.send(key);
}

/// Coalesces events: whatever is waiting when the first arrives (one
/// engine step's worth) leaves as one frame per Router.
async fn send_events(
    transport: Arc<dyn Transport>,
    mut rx: mpsc::UnboundedReceiver<Out>,
    frame_len_max_bytes: u32,
) {
    // A conservative size estimate keeps every batch well under the cap.
    let budget = (frame_len_max_bytes / 4) as usize;
    let mut per_router: HashMap<NodeId, (Vec<ReqEvents>, usize)> = HashMap::new();
    while let Some(first) = rx.recv().await {
        let mut next = Some(first);
        while let Some(o) = next.take() {
            let (router, _, req) = o.key;
            let (batch, size) = per_router.entry(router).or_default();
            let reuse = matches!(batch.last(), Some(r) if r.req == req && r.end.is_none());
            if !reuse {
                batch.push(ReqEvents {
                    req,
                    tokens: Vec::new(),
                    end: None,
                });
                *size += 32;
            }
            let last = batch.last_mut().expect("pushed above");
            match &o.event {
                EngineEvent::Token(s) => {
                    *size += 16 + 8 * s.top.len();
                    last.tokens.push(WireToken::from(s));
                }
                e => {
                    *size += 64;
                    last.end = WireEnd::from_event(e);
                }
            }
            if *size >= budget {
                let (b, _) = per_router.remove(&router).expect("entry exists");
                send_batch(&*transport, router, b);
            }
            next = rx.try_recv().ok();
        }
        for (router, (b, _)) in per_router.drain() {
            send_batch(&*transport, router, b);
        }
    }
}

fn send_batch(transport: &dyn Transport, router: NodeId, batch: Vec<ReqEvents>) {
    if batch.is_empty() {
        return;
    }
    if let Err(e) = transport.send(router, 0, Message::Events(batch)) {
        // The Router is unreachable; its requests are cancelled when it
        // is found silent (or it restarts with a new epoch).
        tracing::warn!("{e}");
    }
}
