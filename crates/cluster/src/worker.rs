//! The engine node's side: requests that arrive over the transport are
//! submitted to the node's own engine (the same Scheduler, KvBlockPool and
//! GpuWorker actors `flotilla serve` runs), and their events go back to
//! the Router per step: the engine sends every event of one step for this
//! node's requests in one message to the node's sink
//! ([`Engine::submit_to`]), and it leaves as one frame per Router (split
//! only near the frame cap). No task and no channel per request.
//!
//! Every request is tied to the Router that sent it and that Router's
//! epoch. When the Router goes silent past the down-after bound, or comes
//! back with a new epoch, its requests are cancelled here, which gives
//! their KV blocks back: a dead Router never strands work on a worker.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use flotilla_config::ClusterSection;
use flotilla_proto::wire::{Held, KvTransferHeader, Message, PrefillMsg, ReqEvents, Submit};
use flotilla_proto::{
    Engine, EngineEvent, EngineFailure, KvLayout, KvMigration, Rejection, RequestId, RequestStream,
    Role, StepEvents,
};
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
    /// `Worker` runs whole requests; `Prefill` computes prompts for decode
    /// nodes; `Decode` continues them (and runs whole requests sent
    /// without a prefill node).
    pub role: Role,
    /// Served model name; KV from another model is refused.
    pub model: String,
    /// Decode side: how long reserved blocks wait for their KV.
    pub reservation_ttl: Duration,
    /// Prefill side: how long a finished prefill's blocks wait for the
    /// decode side's ack.
    pub hold_ttl: Duration,
    /// Priority of each tenant's tier (higher goes first): the order of
    /// waiting KV transfers.
    pub tenant_priority: Vec<u8>,
    /// KV transfers a prefill node sends at once.
    pub transfers_max: usize,
    /// How often the node looks for orphaned leases: engine leases that
    /// none of its requests own, and requests the Router no longer has
    /// here (asked with `Holding`). A lease is given back as an orphan
    /// only when found twice in a row, so it is at least this old.
    pub reconcile_interval: Duration,
    /// Told of every orphan given back (the simulator's leak check).
    pub on_orphan: Option<OrphanHook>,
}

/// Called with a description of each orphaned lease a node gives back.
#[derive(Clone)]
pub struct OrphanHook(pub Arc<dyn Fn(&str) + Send + Sync>);

impl std::fmt::Debug for OrphanHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OrphanHook")
    }
}

impl WorkerOptions {
    /// An engine node's settings from the cluster config: the one place
    /// they are built (`flotilla node`, the simulator and the tests start
    /// from here). The served model, tenants and their priorities come
    /// from the engine's own settings.
    pub fn from_config(cl: &ClusterSection, routers: Vec<NodeId>, role: Role) -> WorkerOptions {
        WorkerOptions {
            routers,
            heartbeat_interval: Duration::from_millis(cl.heartbeat_interval_ms),
            down_after: cl.down_after(),
            num_tenants: 1,
            frame_len_max_bytes: cl.frame_len_max_bytes,
            role,
            model: String::new(),
            reservation_ttl: Duration::from_millis(cl.kv_reservation_ttl_ms),
            hold_ttl: Duration::from_millis(cl.kv_hold_ttl_ms),
            tenant_priority: Vec::new(),
            transfers_max: cl.kv_transfers_max,
            // Orphans are looked for once per down bound.
            reconcile_interval: cl.down_after(),
            on_orphan: None,
        }
    }

    fn priority(&self, tenant: u32) -> u8 {
        self.tenant_priority
            .get(tenant as usize)
            .copied()
            .unwrap_or(0)
    }
}

/// Abandon notices kept for prefills not (yet) seen: a bound on what a
/// Router's messages can make this node remember.
const ABANDONED_MAX: usize = 4096;

/// (router, router epoch, router's request id)
type Key = (NodeId, u64, u64);

/// A prefill served for a decode node: (decode node, its epoch, router,
/// request). A decode node's later life is another key.
type PfKey = (NodeId, u64, u32, u64);

/// Decode side: a request whose blocks are reserved and whose KV has not
/// been imported yet.
struct Importing {
    /// The Router's epoch.
    epoch: u64,
    reservation: RequestId,
    prefill: NodeId,
    deadline: Instant,
    submit: Submit,
    /// Its bytes arrived and are being written: the import task owns the
    /// reservation now and acks the prefill node when it is done.
    writing: bool,
}

/// What spawned tasks tell the node's loop.
enum Ctl {
    /// An import finished (its stream, or why it failed).
    Imported {
        key: (NodeId, u64),
        /// The reservation it wrote: a later placement of the same
        /// request on this node has its own.
        reservation: RequestId,
        prefill: NodeId,
        result: Result<RequestStream, String>,
    },
    /// A prefill task ended; its blocks are given back.
    PrefillDone(PfKey, RequestId),
}

/// What a decode node tells a prefill task.
enum PfCtl {
    Ack,
    Cancel,
}

/// Serves remote Routers (and, on prefill and decode nodes, each other)
/// until `inbound` closes. `kv` is the engine's migration side; without
/// it the node serves whole requests only.
pub async fn run_worker(
    transport: Arc<dyn Transport>,
    mut inbound: mpsc::Receiver<Inbound>,
    engine: Arc<dyn Engine>,
    kv: Option<Arc<dyn KvMigration>>,
    opts: WorkerOptions,
) {
    // Every request's events come through one sink, a message per engine
    // step, and leave as one frame per Router.
    let (sink, mut sink_rx) = mpsc::unbounded_channel::<StepEvents>();
    let (ctl_tx, mut ctl_rx) = mpsc::unbounded_channel::<Ctl>();
    let layout = kv.as_ref().map(|k| k.kv_layout());
    let slots = Slots::new(opts.transfers_max.max(1));
    let mut active = Active::new(opts.frame_len_max_bytes);
    let mut routers: BTreeMap<NodeId, (u64, Instant)> = BTreeMap::new();
    let mut importing: BTreeMap<(NodeId, u64), Importing> = BTreeMap::new();
    // Per ask: the prefill's engine id, the placement it is for, its task.
    let mut prefills: BTreeMap<PfKey, (RequestId, u32, mpsc::UnboundedSender<PfCtl>)> =
        BTreeMap::new();
    // Reservations an import task owns (its bytes are being written).
    let mut import_tasks: BTreeSet<RequestId> = BTreeSet::new();
    let mut orphans = Orphans::new(opts.reconcile_interval);
    // Prefills a Router abandoned (their decode node is lost), until the
    // hold deadline: an ask from that decode node that comes after the
    // abandon (it was in flight) is refused instead of run for nobody.
    let mut abandoned: BTreeMap<PfKey, Instant> = BTreeMap::new();
    // Ends a placement that streamed nothing yet (an import) at the Router.
    let fail_import = |out: &mut Outbox, key: (NodeId, u64), e: &Importing, why: EngineFailure| {
        // Before any token: no stream was forwarded for it.
        out.push(key.0, key.1, e.submit.attempt, 0, EngineEvent::Failed(why));
    };
    let fail = |out: &mut Outbox, key: (NodeId, u64), e: &Importing, why: String| {
        fail_import(out, key, e, EngineFailure::KvTransfer(why));
    };
    // Gives back a reservation and tells its prefill node to stop.
    let drop_import = |key: (NodeId, u64), e: &Importing| {
        tracing::debug!(req = key.1, writing = e.writing, "import dropped");
        if !e.writing {
            if let Some(kv) = &kv {
                let kv = kv.clone();
                let r = e.reservation;
                tokio::spawn(async move { kv.cancel_reservation(r).await });
            }
            let cancel = Message::PrefillCancel {
                router: key.0,
                req: key.1,
                attempt: e.submit.attempt,
            };
            let _ = transport.send(e.prefill, key.1, cancel);
        }
    };
    let mut tick = tokio::time::interval(opts.heartbeat_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        // What the last wake-up produced (a step's events, a failure)
        // leaves now, one frame per Router.
        if !active.outbox.is_empty() {
            active.outbox.flush(&*transport);
        }
        tokio::select! {
            // Deterministic under the simulator: branches in order.
            biased;
            m = inbound.recv() => {
                let Some(m) = m else { return };
                let (from, epoch, msg) = match m {
                    Inbound::Message { from, epoch, msg, .. } => (from, epoch, msg),
                    Inbound::Bulk { from, header, data, .. } => {
                        let key = (header.router, header.req);
                        let ack_no = |why: &str| {
                            tracing::warn!(req = header.req, "KV from node {from} discarded: {why}");
                            let ack = Message::KvAck { router: header.router, req: header.req, ok: false };
                            let _ = transport.send(from, header.req, ack);
                        };
                        let (Some(kv), Some(layout)) = (&kv, &layout) else {
                            ack_no("this node imports no KV");
                            continue;
                        };
                        let Some(e) = importing.get_mut(&key).filter(|e| e.prefill == from && !e.writing) else {
                            // Cancelled or expired meanwhile: the sender may free its blocks.
                            ack_no("no request waits for it");
                            continue;
                        };
                        if let Err(why) = check_header(&header, layout, &opts.model, e.submit.request.prompt.len()) {
                            ack_no(&why);
                            let e = importing.remove(&key).expect("looked up above");
                            drop_import(key, &e);
                            fail(&mut active.outbox, key, &e, why);
                            continue;
                        }
                        e.writing = true;
                        import_tasks.insert(e.reservation);
                        let kv = kv.clone();
                        let (reservation, req) = (e.reservation, e.submit.request.clone());
                        let ctl = ctl_tx.clone();
                        let sink = sink.clone();
                        tokio::spawn(async move {
                            let result = import(&*kv, reservation, header, data, req, sink).await;
                            let _ = ctl.send(Ctl::Imported { key, reservation, prefill: from, result });
                        });
                        continue;
                    }
                };
                // Any message proves a Router alive; a new epoch means it
                // restarted and everything from its old life is orphaned.
                if opts.routers.contains(&from) {
                    let entry = routers.entry(from).or_insert((epoch, Instant::now()));
                    if epoch > entry.0 {
                        transport.reconnect(from);
                        active.stop_where(|k| k.0 == from && k.1 < epoch, &Stop::Cancel);
                        importing.retain(|k, e| {
                            let keep = k.0 != from || e.epoch >= epoch;
                            if !keep {
                                drop_import(*k, e);
                            }
                            keep
                        });
                        entry.0 = epoch;
                    }
                    entry.1 = Instant::now();
                }
                match msg {
                    Message::Submit(s) => {
                        let req = s.req;
                        let tenant = s.request.tenant;
                        if tenant.0 >= opts.num_tenants {
                            let refused = Message::Refused {
                                req,
                                rejection: Rejection::Invalid(format!(
                                    "unknown tenant {} (the config has {})",
                                    tenant.0, opts.num_tenants
                                )),
                            };
                            let _ = transport.send(from, req, refused);
                            continue;
                        }
                        let here = active
                            .attempt(&(from, epoch, req))
                            .or_else(|| importing.get(&(from, req)).map(|e| e.submit.attempt));
                        if let Some(a) = here {
                            if a >= s.attempt {
                                // A duplicate (a resend after a reconnect),
                                // or a late copy of an earlier placement.
                                continue;
                            }
                            // A re-run placed here again that overtook the
                            // Cancel of the earlier placement: end that one.
                            end_placement(&mut active, &mut importing, &drop_import, (from, epoch, req), s.attempt - 1, Stop::Cancel);
                        }
                        if let (Some(p), Some(kvm), Role::Decode) = (s.prefill, &kv, opts.role) {
                            // Disaggregated: blocks first, then ask for the prefill.
                            let ttl = opts.reservation_ttl + opts.heartbeat_interval * 4;
                            let reservation = match kvm.reserve_kv(tenant, s.request.prompt.len() as u32, ttl).await {
                                Ok(r) => r,
                                Err(r) => {
                                    let refused = Message::Refused { req, rejection: r };
                                    let _ = transport.send(from, req, refused);
                                    continue;
                                }
                            };
                            let e = Importing {
                                epoch,
                                reservation,
                                prefill: p,
                                deadline: Instant::now() + opts.reservation_ttl,
                                submit: s.clone(),
                                writing: false,
                            };
                            if transport.send(from, req, Message::Admitted { req }).is_err() {
                                drop_import((from, req), &e);
                                continue;
                            }
                            let ask = Message::Prefill(PrefillMsg {
                                router: from,
                                submit: Submit { prefill: None, ..s },
                                priority: opts.priority(e.submit.request.tenant.0),
                            });
                            if let Err(err) = transport.send(p, req, ask) {
                                let k = kv.clone();
                                tokio::spawn(async move {
                                    if let Some(k) = k {
                                        k.cancel_reservation(reservation).await;
                                    }
                                });
                                fail(&mut active.outbox, (from, req), &e, format!("cannot reach prefill node {p}: {}", err.reason));
                                continue;
                            }
                            tracing::debug!(req, prefill = p, "KV reserved, prefill asked");
                            importing.insert((from, req), e);
                            continue;
                        }
                        tracing::debug!(req, "submit (whole request)");
                        let attempt = s.attempt;
                        let reply = match engine.submit_to(s.request, sink.clone()).await {
                            Ok(stream) => {
                                active.insert((from, epoch, req), stream, attempt);
                                Message::Admitted { req }
                            }
                            Err(rejection) => Message::Refused { req, rejection },
                        };
                        if let Err(e) = transport.send(from, req, reply) {
                            tracing::warn!("{e}");
                            // The Router will not hear of it: do not run it.
                            active.stop(&(from, epoch, req), &Stop::Cancel);
                        }
                    }
                    Message::Cancel { req, stop_string, attempt } => {
                        // Not a later re-run that overtook this Cancel.
                        let stop = if stop_string { Stop::Finished } else { Stop::Cancel };
                        end_placement(&mut active, &mut importing, &drop_import, (from, epoch, req), attempt, stop);
                    }
                    Message::Prefill(pm) => {
                        let (router, req) = (pm.router, pm.submit.req);
                        let key = (from, epoch, router, req);
                        let attempt = pm.submit.attempt;
                        if let Some((_, a, tx)) = prefills.get(&key) {
                            if *a >= attempt {
                                // A duplicate, or a late ask of an earlier placement.
                                continue;
                            }
                            // The decode node asks again for a re-run placed on
                            // it, ahead of its cancel of the earlier ask.
                            let _ = tx.send(PfCtl::Cancel);
                        }
                        let refuse = |reason: String| {
                            let m = Message::PrefillFailed { router, req, reason };
                            let _ = transport.send(from, req, m);
                        };
                        if abandoned.contains_key(&key) {
                            refuse("the Router abandoned this request on this decode node".into());
                            continue;
                        }
                        let Some(kvm) = kv.clone().filter(|_| opts.role == Role::Prefill) else {
                            refuse(format!("node {} is not a prefill node", transport.node()));
                            continue;
                        };
                        if pm.submit.request.tenant.0 >= opts.num_tenants {
                            refuse(format!("unknown tenant {}", pm.submit.request.tenant.0));
                            continue;
                        }
                        let mut r = pm.submit.request;
                        // Only the first token is sampled here; the decode
                        // node samples the rest.
                        r.max_tokens = 1;
                        match kvm.submit_for_export(r, opts.hold_ttl).await {
                            Ok(stream) => {
                                let (tx, rx) = mpsc::unbounded_channel();
                                let id = stream.id;
                                prefills.insert(key, (id, attempt, tx));
                                let task = PrefillTask {
                                    transport: transport.clone(),
                                    kv: kvm,
                                    slots: slots.clone(),
                                    model: opts.model.clone(),
                                    hold_ttl: opts.hold_ttl,
                                    key,
                                    priority: pm.priority,
                                };
                                let ctl = ctl_tx.clone();
                                tokio::spawn(async move {
                                    task.run(stream, rx).await;
                                    let _ = ctl.send(Ctl::PrefillDone(key, id));
                                });
                            }
                            Err(r) => refuse(r.to_string()),
                        }
                    }
                    Message::PrefillFailed { router, req, reason } => {
                        let key = (router, req);
                        if importing.get(&key).is_some_and(|e| e.prefill == from && !e.writing) {
                            let e = importing.remove(&key).expect("checked above");
                            tracing::debug!(req, "prefill failed: reservation cancelled");
                            if let Some(kv) = &kv {
                                kv.cancel_reservation(e.reservation).await;
                            }
                            fail(&mut active.outbox, key, &e, format!("prefill node {from}: {reason}"));
                        }
                    }
                    Message::KvAck { router, req, .. } => {
                        if let Some((_, _, tx)) = prefills.get(&(from, epoch, router, req)) {
                            let _ = tx.send(PfCtl::Ack);
                        }
                    }
                    Message::PrefillCancel { router, req, attempt } => {
                        if let Some((_, a, tx)) = prefills.get(&(from, epoch, router, req))
                            && *a <= attempt
                        {
                            let _ = tx.send(PfCtl::Cancel);
                        }
                    }
                    Message::PrefillAbandon { decode, decode_epoch, req } if opts.routers.contains(&from) => {
                        let key = (decode, decode_epoch, from, req);
                        if let Some((_, _, tx)) = prefills.get(&key) {
                            tracing::debug!(req, "prefill for node {decode} abandoned by the Router");
                            let _ = tx.send(PfCtl::Cancel);
                        } else if abandoned.len() < ABANDONED_MAX {
                            abandoned.insert(key, Instant::now() + opts.hold_ttl);
                        }
                    }
                    Message::Unknown { held } if opts.routers.contains(&from) => {
                        // Named twice in a row: nobody will end it but us.
                        let before = orphans.unknown.remove(&from).unwrap_or_default();
                        let mut named = BTreeSet::new();
                        for h in held {
                            if !before.contains(&h) {
                                named.insert(h);
                                continue;
                            }
                            let req = h.req;
                            let mut gave_back = false;
                            if let Some(d) = h.for_decode {
                                for (_, (_, _, tx)) in prefills.iter().filter(|(k, _)| k.0 == d && k.2 == from && k.3 == req) {
                                    let _ = tx.send(PfCtl::Cancel);
                                    gave_back = true;
                                }
                            } else {
                                gave_back = end_placement(&mut active, &mut importing, &drop_import, (from, epoch, req), u32::MAX, Stop::Cancel);
                            }
                            if gave_back {
                                orphans.found += 1;
                                orphan(&opts, &format!("node {}: {h:?} of router {from}, which the Router no longer has here", transport.node()));
                            }
                        }
                        orphans.unknown.insert(from, named);
                    }
                    Message::Ping { seq, pad } => {
                        let _ = transport.send(from, seq, Message::Pong { seq, pad });
                    }
                    _ => {}
                }
            }
            Some(step) = sink_rx.recv() => active.on_step(step, &import_tasks),
            Some(c) = ctl_rx.recv() => match c {
                Ctl::Imported { key, reservation, prefill, result } => {
                    import_tasks.remove(&reservation);
                    // Placed below (the request keeps the reservation's id)
                    // or dropped: its early events go with it either way.
                    let early = active.early.remove(&reservation);
                    let ok = result.is_ok();
                    tracing::debug!(req = key.1, ok, "import done");
                    let ack = Message::KvAck { router: key.0, req: key.1, ok };
                    let _ = transport.send(prefill, key.1, ack);
                    // Only the placement this import was for: if the Router
                    // cancelled it and placed the request here again, the
                    // entry now is the new placement's (its own reservation,
                    // its own prefill), which this import must not end.
                    let mine = importing.get(&key).is_some_and(|e| e.reservation == reservation && e.writing);
                    let entry = if mine { importing.remove(&key) } else { None };
                    match (entry, result) {
                        (Some(e), Ok(stream)) => {
                            if let Some(ev) = early {
                                active.early.insert(stream.id, ev);
                            }
                            active.insert((key.0, e.epoch, key.1), stream, e.submit.attempt);
                        }
                        // Cancelled while its bytes were written: dropping
                        // the stream ends it and frees its blocks.
                        (None, Ok(stream)) => drop(stream),
                        (Some(e), Err(why)) => fail(&mut active.outbox, key, &e, why),
                        (None, Err(_)) => {}
                    }
                }
                Ctl::PrefillDone(key, id) => {
                    // Not a later ask's entry under the same key.
                    if prefills.get(&key).is_some_and(|(i, _, _)| *i == id) {
                        prefills.remove(&key);
                    }
                }
            },
            _ = tick.tick() => {
                let mut report = engine.status().await;
                report.orphans = orphans.found;
                for &r in &opts.routers {
                    // Unreachable Routers are noticed below, by silence.
                    let _ = transport.send(r, 0, Message::Heartbeat(report.clone()));
                }
                let now = Instant::now();
                abandoned.retain(|_, until| *until > now);
                if now >= orphans.next {
                    orphans.next = now + orphans.interval;
                    // Engine leases that no entry of this node owns: nobody
                    // here will ever give them back.
                    if let Some(kvm) = &kv {
                        let owned: BTreeSet<RequestId> = active
                            .by_id
                            .keys()
                            .copied()
                            .chain(importing.values().map(|e| e.reservation))
                            .chain(prefills.values().map(|(id, _, _)| *id))
                            .chain(import_tasks.iter().copied())
                            .collect();
                        let holders = kvm.kv_holders().await;
                        let mut still = BTreeSet::new();
                        for id in holders.into_iter().filter(|id| !owned.contains(id)) {
                            if orphans.unowned.contains(&id) && kvm.drop_orphan(id).await {
                                orphans.found += 1;
                                orphan(&opts, &format!("node {}: engine lease {id} owned by no request here", transport.node()));
                            } else {
                                still.insert(id);
                            }
                        }
                        orphans.unowned = still;
                    }
                    // Ask each Router about what this node holds for it
                    // (only what it held at the last look as well).
                    for &r in &opts.routers {
                        let here = |req| Held { req, for_decode: None };
                        let held: BTreeSet<Held> = active
                            .map
                            .keys()
                            .filter(|k| k.0 == r)
                            .map(|k| here(k.2))
                            .chain(importing.keys().filter(|k| k.0 == r).map(|k| here(k.1)))
                            .chain(prefills.keys().filter(|k| k.2 == r).map(|k| Held { req: k.3, for_decode: Some(k.0) }))
                            .collect();
                        let before = orphans.held.insert(r, held.clone()).unwrap_or_default();
                        let ask: Vec<Held> = held.intersection(&before).copied().collect();
                        if !ask.is_empty() {
                            let _ = transport.send(r, 0, Message::Holding { held: ask });
                        }
                    }
                }
                let silent: Vec<NodeId> = routers
                    .iter()
                    .filter(|(_, (_, heard))| now.duration_since(*heard) > opts.down_after)
                    .map(|(n, _)| *n)
                    .collect();
                for n in silent {
                    let before = active.map.len() + importing.len();
                    // Told to the Router too, in case only its direction
                    // of the link is cut: it runs them again or ends them.
                    let why = format!("no message from the Router for over {} ms", opts.down_after.as_millis());
                    active.stop_where(|k| k.0 == n, &Stop::RouterSilent(why.clone()));
                    importing.retain(|k, e| {
                        if k.0 == n {
                            drop_import(*k, e);
                            fail_import(&mut active.outbox, *k, e, EngineFailure::RouterLost(why.clone()));
                        }
                        k.0 != n
                    });
                    let cancelled = before - active.map.len() - importing.len();
                    if cancelled > 0 {
                        tracing::warn!(router = n, "router silent for over {:?}: cancelled {cancelled} requests", opts.down_after);
                    }
                    routers.remove(&n);
                }
                // Reservations whose KV never came.
                let late: Vec<(NodeId, u64)> = importing
                    .iter()
                    .filter(|(_, e)| !e.writing && e.deadline <= now)
                    .map(|(k, _)| *k)
                    .collect();
                for k in late {
                    let e = importing.remove(&k).expect("listed above");
                    drop_import(k, &e);
                    let ms = opts.reservation_ttl.as_millis();
                    fail(&mut active.outbox, k, &e, format!("no KV from prefill node {} within {ms} ms", e.prefill));
                }
            }
        }
    }
}

/// Whether a transfer fits this node's cache and the request it is for.
fn check_header(
    h: &KvTransferHeader,
    layout: &KvLayout,
    model: &str,
    prompt_len: usize,
) -> Result<(), String> {
    let blocks = (prompt_len as u64).div_ceil(u64::from(layout.block_size.max(1)));
    if h.model != model {
        return Err(format!(
            "KV of model '{}', this node serves '{model}'",
            h.model
        ));
    }
    if h.block_size != layout.block_size
        || h.dtype != layout.dtype
        || h.layout != layout.layout
        || h.layer_start != 0
        || h.layer_end != layout.layers
    {
        return Err(format!(
            "KV layout differs: blocks of {} tokens, dtype {}, layout {}, layers {}..{}; \
             this node has {} tokens, dtype {}, layout {}, {} layers",
            h.block_size,
            h.dtype,
            h.layout,
            h.layer_start,
            h.layer_end,
            layout.block_size,
            layout.dtype,
            layout.layout,
            layout.layers
        ));
    }
    if h.token_count as usize != prompt_len
        || u64::from(h.block_count) != blocks
        || h.bytes != blocks * layout.bytes_per_block
    {
        return Err(format!(
            "transfer of {} tokens in {} blocks ({} bytes) for a prompt of {prompt_len} tokens \
             ({blocks} blocks of {} bytes)",
            h.token_count, h.block_count, h.bytes, layout.bytes_per_block
        ));
    }
    Ok(())
}

/// Verifies a transfer's checksum, then writes it into its reservation
/// and continues the request from the prefill node's first token.
async fn import(
    kv: &dyn KvMigration,
    reservation: RequestId,
    h: KvTransferHeader,
    data: Vec<Bytes>,
    req: flotilla_proto::EngineRequest,
    sink: flotilla_proto::EventSink,
) -> Result<RequestStream, String> {
    let mut bytes = Vec::with_capacity(h.bytes as usize);
    let mut crc = crc32fast::Hasher::new();
    for c in &data {
        crc.update(c);
        bytes.extend_from_slice(c);
    }
    drop(data);
    let sum = u64::from(crc.finalize());
    if bytes.len() as u64 != h.bytes || sum != h.checksum {
        kv.cancel_reservation(reservation).await;
        return Err(format!(
            "KV transfer corrupt: {} of {} bytes, checksum {sum:#x}, expected {:#x}",
            bytes.len(),
            h.bytes,
            h.checksum
        ));
    }
    kv.import_kv(reservation, h.token_count, bytes, req, h.first, Some(sink))
        .await
        .map_err(|r| format!("decode node refused the KV: {r}"))
}

/// Prefill side of one request: run it, wait for a transfer slot (higher
/// tiers first), send its KV, wait for the ack, give the blocks back. The
/// blocks go back on every path: cancel, failure, a lost decode node (the
/// transfer fails or no ack comes within `hold_ttl`).
struct PrefillTask {
    transport: Arc<dyn Transport>,
    kv: Arc<dyn KvMigration>,
    slots: Arc<Slots>,
    model: String,
    hold_ttl: Duration,
    key: PfKey,
    priority: u8,
}

impl PrefillTask {
    async fn run(self, stream: RequestStream, mut ctl: mpsc::UnboundedReceiver<PfCtl>) {
        let id = stream.id;
        let (decode, _, router, req) = self.key;
        match self.send(stream, &mut ctl).await {
            Ok(true) => {}
            Ok(false) => {
                // Wait for the ack (or a cancel); a decode node that died
                // never sends one.
                let r = tokio::time::timeout(self.hold_ttl, ctl.recv()).await;
                tracing::debug!(
                    req,
                    "prefill for node {decode}: KV sent, then {:?}",
                    r.map(|c| c.map(|c| matches!(c, PfCtl::Ack)))
                );
            }
            Err(Some(reason)) => {
                tracing::warn!(req, "prefill for node {decode} failed: {reason}");
                let m = Message::PrefillFailed {
                    router,
                    req,
                    reason,
                };
                let _ = self.transport.send(decode, req, m);
            }
            Err(None) => tracing::debug!(req, "prefill for node {decode} cancelled"),
        }
        let released = self.kv.release_kv(id).await;
        tracing::debug!(req, released, "prefill for node {decode} ends");
    }

    /// Ok(acked already) once the KV is sent; Err(None) when cancelled,
    /// Err(reason) when it failed.
    async fn send(
        &self,
        mut stream: RequestStream,
        ctl: &mut mpsc::UnboundedReceiver<PfCtl>,
    ) -> Result<bool, Option<String>> {
        let (decode, _, router, req) = self.key;
        let id = stream.id;
        let mut first = None;
        loop {
            tokio::select! {
                // Deterministic under the simulator: branches in order.
                biased;
                ev = stream.recv() => match ev {
                    Some(EngineEvent::Token(s)) => first = Some(s),
                    Some(EngineEvent::Finished { .. }) => break,
                    Some(EngineEvent::Failed(f)) => return Err(Some(f.to_string())),
                    None => return Err(Some("the engine dropped the prefill".into())),
                },
                c = ctl.recv() => if !matches!(c, Some(PfCtl::Ack)) {
                    return Err(None);
                },
            }
        }
        // Finished: its blocks stay held until `release_kv`.
        drop(stream);
        let first = first.ok_or_else(|| Some("the prefill sampled no token".to_string()))?;
        let _slot = tokio::select! {
            // Deterministic under the simulator: branches in order.
            biased;
            s = self.slots.acquire(self.priority) => s,
            _ = ctl.recv() => return Err(None),
        };
        let exp = self.kv.export_kv(id).await.map_err(Some)?;
        let layout = self.kv.kv_layout();
        let header = KvTransferHeader {
            router,
            req,
            epoch: self.transport.epoch(),
            model: self.model.clone(),
            block_size: layout.block_size,
            dtype: layout.dtype,
            layout: layout.layout,
            layer_start: 0,
            layer_end: layout.layers,
            token_count: exp.tokens,
            block_count: exp.blocks,
            bytes: exp.data.len() as u64,
            checksum: u64::from(crc32fast::hash(&exp.data)),
            first,
        };
        let (bytes, t0) = (exp.data.len(), Instant::now());
        tokio::select! {
            // Deterministic under the simulator: branches in order.
            biased;
            r = self.transport.send_bulk(decode, header, Bytes::from(exp.data)) => {
                let us = t0.elapsed().as_micros().max(1);
                tracing::debug!(req, bytes, us, "KV sent to node {decode}: {:.3} GB/s", bytes as f64 / us as f64 / 1e3);
                r.map(|()| false).map_err(|e| Some(format!("sending KV to node {decode}: {e}")))
            }
            // The decode side acks once it has read the whole transfer,
            // which may come before the send resolves here.
            c = ctl.recv() => match c {
                Some(PfCtl::Ack) => Ok(true),
                _ => Err(None),
            },
        }
    }
}

/// Transfer slots handed out by priority (then arrival): a paid tier's KV
/// leaves before a free tier's that waited longer.
pub(crate) struct Slots {
    st: Mutex<SlotsState>,
}

struct SlotsState {
    free: usize,
    waiting: BinaryHeap<Waiter>,
    seq: u64,
}

struct Waiter {
    priority: u8,
    seq: u64,
    tx: oneshot::Sender<Slot>,
}

impl PartialEq for Waiter {
    fn eq(&self, o: &Self) -> bool {
        self.seq == o.seq
    }
}
impl Eq for Waiter {}
impl PartialOrd for Waiter {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Waiter {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.priority, Reverse(self.seq)).cmp(&(o.priority, Reverse(o.seq)))
    }
}

/// Transfer slots for tests.
#[cfg(test)]
pub(crate) fn test_slots(n: usize) -> Arc<Slots> {
    Slots::new(n)
}

/// A held transfer slot; dropping it hands it to the best waiter.
pub(crate) struct Slot {
    slots: Option<Arc<Slots>>,
}

impl Slots {
    fn new(n: usize) -> Arc<Slots> {
        Arc::new(Slots {
            st: Mutex::new(SlotsState {
                free: n,
                waiting: BinaryHeap::new(),
                seq: 0,
            }),
        })
    }

    pub(crate) async fn acquire(self: &Arc<Self>, priority: u8) -> Slot {
        let rx = {
            let mut st = self.st.lock().expect("slots poisoned");
            if st.free > 0 {
                st.free -= 1;
                return Slot {
                    slots: Some(self.clone()),
                };
            }
            let (tx, rx) = oneshot::channel();
            st.seq += 1;
            let seq = st.seq;
            st.waiting.push(Waiter { priority, seq, tx });
            rx
        };
        // The sender lives in `waiting` until it is handed a slot.
        rx.await.unwrap_or(Slot { slots: None })
    }

    fn release(self: &Arc<Self>) {
        let mut st = self.st.lock().expect("slots poisoned");
        while let Some(w) = st.waiting.pop() {
            match w.tx.send(Slot {
                slots: Some(self.clone()),
            }) {
                Ok(()) => return,
                // That waiter gave up; the slot it refused must not
                // release itself again (we hold the lock).
                Err(mut s) => {
                    s.slots = None;
                }
            }
        }
        st.free += 1;
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(s) = self.slots.take() {
            s.release();
        }
    }
}

/// Why a running request is stopped on this node.
#[derive(Clone, Debug)]
enum Stop {
    /// Its Router cancelled it (or is gone for good).
    Cancel,
    /// Its Router matched a stop string: it finished.
    Finished,
    /// Its Router is silent past the down bound: dropped here, and the
    /// Router is told (its messages may still reach it).
    RouterSilent(String),
}

/// Ends request `key` of a Router on this node, running or being
/// imported, if its placement is `attempt` or earlier (a later re-run
/// stays). True if something was ended.
fn end_placement(
    active: &mut Active,
    importing: &mut BTreeMap<(NodeId, u64), Importing>,
    drop_import: &dyn Fn((NodeId, u64), &Importing),
    key: Key,
    attempt: u32,
    stop: Stop,
) -> bool {
    let (router, _, req) = key;
    let mut ended = false;
    if active.attempt(&key).is_some_and(|a| a <= attempt) {
        ended = active.stop(&key, &stop);
    }
    if importing
        .get(&(router, req))
        .is_some_and(|e| e.submit.attempt <= attempt)
        && let Some(e) = importing.remove(&(router, req))
    {
        drop_import((router, req), &e);
        ended = true;
    }
    ended
}

/// Reports an orphaned lease that was given back.
fn orphan(opts: &WorkerOptions, what: &str) {
    tracing::warn!("orphaned lease given back: {what}");
    if let Some(h) = &opts.on_orphan {
        (h.0)(what);
    }
}

/// Orphan hunting state: what was suspect at the last look. A lease is
/// an orphan only if it is suspect at two looks in a row, a reconcile
/// interval apart, so requests in the middle of being set up or torn
/// down (a reply in flight, an ack on its way) are never taken for one.
struct Orphans {
    interval: Duration,
    next: Instant,
    /// Engine ids that none of this node's entries owned at the last look.
    unowned: BTreeSet<RequestId>,
    /// Per Router: what was held at the last look (only those are sent
    /// in `Holding`, so every one named is at least an interval old).
    held: BTreeMap<NodeId, BTreeSet<Held>>,
    /// Per Router: what its last `Unknown` named.
    unknown: BTreeMap<NodeId, BTreeSet<Held>>,
    /// Requests given back as orphans since start.
    found: u64,
}

impl Orphans {
    fn new(interval: Duration) -> Orphans {
        Orphans {
            interval,
            next: Instant::now() + interval,
            unowned: BTreeSet::new(),
            held: BTreeMap::new(),
            unknown: BTreeMap::new(),
            found: 0,
        }
    }
}

/// A request running here for a Router.
struct Running {
    /// The engine's handle: dropping it cancels the request, or finishes
    /// it once marked as ended at a stop string. Its events come through
    /// the node's sink.
    stream: RequestStream,
    /// The placement (`Submit::attempt`).
    attempt: u32,
    /// Events sent to the Router so far: the next one's index.
    index: u32,
}

/// The requests running here for Routers, and their events on the way
/// back.
struct Active {
    map: BTreeMap<Key, Running>,
    /// The Router's key of each engine request.
    by_id: BTreeMap<RequestId, Key>,
    /// Events of imports whose result has not reached this loop yet (the
    /// engine delivers an import's first token as it answers): kept
    /// until the import is placed here, or dropped with it.
    early: BTreeMap<RequestId, Vec<EngineEvent>>,
    outbox: Outbox,
}

impl Active {
    fn new(frame_len_max_bytes: u32) -> Active {
        Active {
            map: BTreeMap::new(),
            by_id: BTreeMap::new(),
            early: BTreeMap::new(),
            outbox: Outbox::new(frame_len_max_bytes),
        }
    }

    /// The placement running under `key`, if any.
    fn attempt(&self, key: &Key) -> Option<u32> {
        self.map.get(key).map(|r| r.attempt)
    }

    /// Runs `stream` (placement `attempt`) under `key`; one still there is
    /// ended. Events that came for it before are sent now.
    fn insert(&mut self, key: Key, stream: RequestStream, attempt: u32) {
        let id = stream.id;
        let running = Running {
            stream,
            attempt,
            index: 0,
        };
        if let Some(old) = self.map.insert(key, running) {
            self.by_id.remove(&old.stream.id);
        }
        self.by_id.insert(id, key);
        if let Some(early) = self.early.remove(&id) {
            self.on_step(
                early.into_iter().map(|e| (id, e)).collect(),
                &BTreeSet::new(),
            );
        }
    }

    /// Ends the request under `key`; false if none runs.
    fn stop(&mut self, key: &Key, why: &Stop) -> bool {
        let Some(mut r) = self.map.remove(key) else {
            return false;
        };
        self.by_id.remove(&r.stream.id);
        match why {
            Stop::Cancel => {}
            Stop::Finished => r.stream.ended_by_stop_string(),
            Stop::RouterSilent(why) => {
                let ev = EngineEvent::Failed(EngineFailure::RouterLost(why.clone()));
                self.outbox.push(key.0, key.2, r.attempt, r.index, ev);
            }
        }
        // Dropping the handle ends it in the engine.
        true
    }

    fn stop_where(&mut self, f: impl Fn(&Key) -> bool, why: &Stop) {
        let keys: Vec<Key> = self.map.keys().filter(|k| f(k)).copied().collect();
        for k in keys {
            self.stop(&k, why);
        }
    }

    /// One engine step's events for this node's requests: onto the
    /// Routers' batches, in order; an ended request is forgotten. Events of
    /// an import in `importing` wait for it to be placed.
    fn on_step(&mut self, events: StepEvents, importing: &BTreeSet<RequestId>) {
        for (id, ev) in events {
            let Some(&key) = self.by_id.get(&id) else {
                if importing.contains(&id) {
                    self.early.entry(id).or_default().push(ev);
                }
                // Else stopped here meanwhile: its Router does not want it.
                continue;
            };
            let r = self
                .map
                .get_mut(&key)
                .expect("by_id names running requests");
            let end = !matches!(ev, EngineEvent::Token(_));
            self.outbox.push(key.0, key.2, r.attempt, r.index, ev);
            r.index += 1;
            if end {
                self.by_id.remove(&id);
                self.map.remove(&key);
            }
        }
    }
}

/// Events on their way to the Routers: one batch per Router, sent when
/// the node's loop has handled what it was woken for (a step's events
/// leave as one frame), or earlier once a batch nears the frame cap.
struct Outbox {
    /// A conservative size estimate keeps every batch well under the cap.
    budget: usize,
    per_router: BTreeMap<NodeId, (Vec<ReqEvents>, usize)>,
    full: Vec<(NodeId, Vec<ReqEvents>)>,
}

impl Outbox {
    fn new(frame_len_max_bytes: u32) -> Outbox {
        Outbox {
            budget: (frame_len_max_bytes / 4) as usize,
            per_router: BTreeMap::new(),
            full: Vec::new(),
        }
    }

    /// Queues event `index` of the Router's request `req` (placement
    /// `attempt`).
    fn push(&mut self, router: NodeId, req: u64, attempt: u32, index: u32, event: EngineEvent) {
        let (batch, size) = self.per_router.entry(router).or_default();
        let reuse = matches!(batch.last(), Some(r) if r.req == req && r.attempt == attempt
            && r.first + r.events.len() as u32 == index && r.end().is_none());
        if !reuse {
            batch.push(ReqEvents {
                req,
                attempt,
                first: index,
                events: Vec::new(),
            });
            *size += 32;
        }
        *size += match &event {
            EngineEvent::Token(s) => 24 + 8 * s.top.len(),
            EngineEvent::Failed(f) => 64 + f.to_string().len(),
            EngineEvent::Finished { .. } => 64,
        };
        batch.last_mut().expect("pushed above").events.push(event);
        if *size >= self.budget {
            let (b, _) = self.per_router.remove(&router).expect("entry exists");
            self.full.push((router, b));
        }
    }

    /// Sends everything queued.
    fn flush(&mut self, transport: &dyn Transport) {
        let batches = self.full.drain(..).chain(
            std::mem::take(&mut self.per_router)
                .into_iter()
                .map(|(r, (b, _))| (r, b)),
        );
        for (router, batch) in batches {
            if batch.is_empty() {
                continue;
            }
            if let Err(e) = transport.send(router, 0, Message::Events(batch)) {
                // The Router is unreachable; its requests are cancelled when
                // it is found silent (or it restarts with a new epoch).
                tracing::warn!("{e}");
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.full.is_empty() && self.per_router.is_empty()
    }
}
