//! Disaggregated prefill and decode over the simulated network, with a
//! fake engine that keeps real block accounting: the happy path and every
//! abort path, each ending with every block back on every node.

// Tests spawn nodes on the runtime (on a paused clock: see `testrig`).
#![allow(clippy::disallowed_methods)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flotilla_engine::{BoxFuture, Engine, EventSink, KvMigration, RequestStream};
use flotilla_proto::{
    EngineEvent, EngineFailure, EngineRequest, EngineStatus, FinishReason, KvExport, KvLayout,
    KvUsage, Rejection, RequestId, Role, Sampled, SamplingParams, TenantId, Usage,
};
use flotilla_transport::NodeId;
use tokio::sync::mpsc;

use crate::testrig::{
    drain, net, pass, router_opts, start_router, start_router_with, until, wait_up,
};
use crate::{
    ClusterEngine, NodeCore, NodeSettings, NodeStep, Recorder, RouterCore, RouterHooks,
    RouterInput, RouterStep, WorkerOptions, run_worker,
};
use flotilla_transport::sim::SimNet;

pub(crate) const HB: Duration = Duration::from_millis(20);
pub(crate) const DOWN: Duration = Duration::from_millis(80);
pub(crate) const BS: u32 = 4;
const TTL: Duration = Duration::from_millis(400);

/// The fake model: token `k` of a request depends on its whole prompt.
fn tok(prompt: &[u32], k: u32) -> u32 {
    prompt
        .iter()
        .fold(17u32, |a, &t| a.wrapping_mul(31).wrapping_add(t))
        .wrapping_add(k * 7)
        % 50_000
}

fn sampled(token: u32) -> Sampled {
    Sampled {
        token,
        logprob: f32::NAN,
        top: vec![],
    }
}

enum Slot {
    /// A whole request or a prefill, running.
    Running(u32),
    /// A finished prefill's blocks and prompt, waiting for export.
    Held(u32, Vec<u32>),
    Reserved(u32),
}

#[derive(Default)]
struct Inner {
    total: u32,
    free: Mutex<u32>,
    slots: Mutex<HashMap<u64, Slot>>,
    next: AtomicU64,
    prefill_ms: AtomicU64,
    import_ms: AtomicU64,
    refuse_reserve: AtomicBool,
    prefills: AtomicUsize,
    imports: AtomicUsize,
    exports: AtomicUsize,
    orphans_dropped: AtomicUsize,
    /// Block hashes of every prompt it ran (a prefix cache that keeps
    /// all), and those not reported yet.
    cache: Mutex<(std::collections::BTreeSet<u64>, Vec<u64>)>,
    /// Prompts it ran, in order.
    prompts: Mutex<Vec<Vec<u32>>>,
}

/// An engine with block accounting: a block is free, running, held or reserved.
#[derive(Clone)]
pub(crate) struct FakePd(Arc<Inner>);

impl FakePd {
    pub(crate) fn new(total: u32) -> FakePd {
        FakePd(Arc::new(Inner {
            total,
            free: Mutex::new(total),
            ..Inner::default()
        }))
    }

    fn take(&self, n: u32) -> Result<(), Rejection> {
        let mut f = self.0.free.lock().unwrap();
        if *f < n {
            return Err(Rejection::QueueFull {
                tier: "default".into(),
                queue_len_max: 0,
                retry_after_s: 1,
            });
        }
        *f -= n;
        Ok(())
    }

    fn give(&self, n: u32) {
        *self.0.free.lock().unwrap() += n;
    }

    /// Drops slot `id` and frees its blocks, if it is in a state `f` accepts.
    fn free_if(&self, id: u64, f: impl Fn(&Slot) -> bool) -> bool {
        let mut slots = self.0.slots.lock().unwrap();
        if !slots.get(&id).is_some_and(&f) {
            return false;
        }
        let n = match slots.remove(&id).unwrap() {
            Slot::Running(n) | Slot::Held(n, _) | Slot::Reserved(n) => n,
        };
        drop(slots);
        self.give(n);
        true
    }

    /// The prompts it ran, in order.
    pub(crate) fn prompts(&self) -> Vec<Vec<u32>> {
        self.0.prompts.lock().unwrap().clone()
    }

    pub(crate) fn used(&self) -> u32 {
        self.0.total - *self.0.free.lock().unwrap()
    }

    /// Streams tokens `from..max_tokens` of `prompt` for slot `id`, then
    /// `Finished`; the stream's drop frees a running slot.
    fn stream(&self, id: u64, prompt: Vec<u32>, from: u32, req: &EngineRequest) -> RequestStream {
        let (tx, rx) = mpsc::unbounded_channel();
        let max = req.max_tokens;
        let plen = prompt.len() as u32;
        tokio::spawn(async move {
            for k in from..max {
                pass(Duration::from_millis(2)).await;
                if tx
                    .send(EngineEvent::Token(sampled(tok(&prompt, k))))
                    .is_err()
                {
                    return;
                }
            }
            let _ = tx.send(EngineEvent::Finished {
                reason: FinishReason::Length,
                usage: Usage {
                    prompt_tokens: plen,
                    completion_tokens: max,
                    cached_tokens: 0,
                },
            });
        });
        let me = self.clone();
        RequestStream::new(
            RequestId(id),
            rx,
            Box::new(move |_| {
                me.free_if(id, |s| matches!(s, Slot::Running(_)));
            }),
        )
    }
}

fn blocks(tokens: u32) -> u32 {
    tokens.div_ceil(BS)
}

impl Engine for FakePd {
    fn submit(&self, req: EngineRequest) -> BoxFuture<Result<RequestStream, Rejection>> {
        let me = self.clone();
        Box::pin(async move {
            let n = blocks(req.prompt.len() as u32 + req.max_tokens);
            me.take(n)?;
            let id = me.0.next.fetch_add(1, Ordering::Relaxed);
            me.0.slots.lock().unwrap().insert(id, Slot::Running(n));
            {
                let mut c = me.0.cache.lock().unwrap();
                for h in flotilla_kv::prefix_hashes(&req.prompt, BS as usize, 0) {
                    if c.0.insert(h) {
                        c.1.push(h);
                    }
                }
            }
            me.0.prompts.lock().unwrap().push(req.prompt.clone());
            Ok(me.stream(id, req.prompt.clone(), 0, &req))
        })
    }

    fn status(&self) -> BoxFuture<EngineStatus> {
        let (total, used) = (self.0.total, self.used());
        Box::pin(async move {
            EngineStatus {
                ready: true,
                kv: KvUsage {
                    total,
                    free: total - used,
                    used,
                    cached: 0,
                    ..KvUsage::default()
                },
                ..EngineStatus::default()
            }
        })
    }
}

impl KvMigration for FakePd {
    fn kv_layout(&self) -> KvLayout {
        KvLayout {
            block_size: BS,
            dtype: flotilla_proto::KvDtype::F16,
            layout: 1,
            layers: 1,
            bytes_per_block: u64::from(BS) * 4,
        }
    }

    fn submit_for_export(
        &self,
        req: EngineRequest,
        hold_for: Duration,
    ) -> BoxFuture<Result<RequestStream, Rejection>> {
        let me = self.clone();
        Box::pin(async move {
            assert_eq!(req.max_tokens, 1, "a prefill samples one token");
            let n = blocks(req.prompt.len() as u32);
            me.take(n)?;
            me.0.prefills.fetch_add(1, Ordering::SeqCst);
            let id = me.0.next.fetch_add(1, Ordering::Relaxed);
            me.0.slots.lock().unwrap().insert(id, Slot::Running(n));
            let (tx, rx) = mpsc::unbounded_channel();
            let delay = Duration::from_millis(me.0.prefill_ms.load(Ordering::SeqCst));
            let m2 = me.clone();
            tokio::spawn(async move {
                pass(delay).await;
                {
                    let mut slots = m2.0.slots.lock().unwrap();
                    // Cancelled meanwhile.
                    if !matches!(slots.get(&id), Some(Slot::Running(_))) {
                        return;
                    }
                    slots.insert(id, Slot::Held(n, req.prompt.clone()));
                }
                let _ = tx.send(EngineEvent::Token(sampled(tok(&req.prompt, 0))));
                let _ = tx.send(EngineEvent::Finished {
                    reason: FinishReason::Length,
                    usage: Usage::default(),
                });
                pass(hold_for).await;
                m2.free_if(id, |s| matches!(s, Slot::Held(..)));
            });
            let m3 = me.clone();
            Ok(RequestStream::new(
                RequestId(id),
                rx,
                Box::new(move |_| {
                    m3.free_if(id, |s| matches!(s, Slot::Running(_)));
                }),
            ))
        })
    }

    fn export_kv(&self, id: RequestId) -> BoxFuture<Result<KvExport, String>> {
        let me = self.clone();
        Box::pin(async move {
            let slots = me.0.slots.lock().unwrap();
            let Some(Slot::Held(n, prompt)) = slots.get(&id.0) else {
                return Err(format!("{id} holds no blocks"));
            };
            me.0.exports.fetch_add(1, Ordering::SeqCst);
            let mut data: Vec<u8> = prompt.iter().flat_map(|t| t.to_le_bytes()).collect();
            data.resize((*n * BS * 4) as usize, 0);
            Ok(KvExport {
                tokens: prompt.len() as u32,
                blocks: *n,
                data,
            })
        })
    }

    fn detach_kv(&self, id: RequestId, _hold_for: Duration) -> BoxFuture<Result<Vec<u32>, String>> {
        // Its streams are not stepped here: nothing is ever decoding.
        Box::pin(async move { Err(format!("{id} is not decoding")) })
    }

    fn release_kv(&self, id: RequestId) -> BoxFuture<bool> {
        let r = self.free_if(id.0, |s| matches!(s, Slot::Held(..)));
        Box::pin(async move { r })
    }

    fn reserve_kv(
        &self,
        _tenant: TenantId,
        tokens: u32,
        ttl: Duration,
    ) -> BoxFuture<Result<RequestId, Rejection>> {
        let me = self.clone();
        Box::pin(async move {
            if me.0.refuse_reserve.load(Ordering::SeqCst) {
                me.take(u32::MAX)?;
            }
            let n = blocks(tokens);
            me.take(n)?;
            let id = me.0.next.fetch_add(1, Ordering::Relaxed);
            me.0.slots.lock().unwrap().insert(id, Slot::Reserved(n));
            let m2 = me.clone();
            tokio::spawn(async move {
                pass(ttl).await;
                m2.free_if(id, |s| matches!(s, Slot::Reserved(_)));
            });
            Ok(RequestId(id))
        })
    }

    fn import_kv(
        &self,
        reservation: RequestId,
        tokens: u32,
        data: Vec<u8>,
        req: EngineRequest,
        first: Sampled,
        sink: Option<EventSink>,
    ) -> BoxFuture<Result<RequestStream, Rejection>> {
        let me = self.clone();
        Box::pin(async move {
            pass(Duration::from_millis(me.0.import_ms.load(Ordering::SeqCst))).await;
            let id = reservation.0;
            let reserved = match me.0.slots.lock().unwrap().remove(&id) {
                Some(Slot::Reserved(n)) => n,
                _ => return Err(Rejection::Invalid(format!("no reservation {id}"))),
            };
            // The continuation is computed from the imported KV alone.
            let prompt: Vec<u32> = data
                .chunks_exact(4)
                .take(tokens as usize)
                .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            let need = blocks(tokens + req.max_tokens);
            if let Err(r) = me.take(need - reserved) {
                me.give(reserved);
                return Err(r);
            }
            me.0.imports.fetch_add(1, Ordering::SeqCst);
            me.0.slots.lock().unwrap().insert(id, Slot::Running(need));
            let (tx, rx) = mpsc::unbounded_channel();
            let _ = tx.send(EngineEvent::Token(first));
            let mut s = me.stream(id, prompt, 1, &req);
            // Splice: `first`, then the rest.
            let (tx2, rx2) = (tx, rx);
            tokio::spawn(async move {
                while let Some(e) = s.recv().await {
                    if tx2.send(e).is_err() {
                        break;
                    }
                }
                drop(s);
            });
            let m2 = me.clone();
            let stream = RequestStream::new(
                RequestId(id),
                rx2,
                Box::new(move |_| {
                    m2.free_if(id, |s| matches!(s, Slot::Running(_)));
                }),
            );
            Ok(match sink {
                Some(sink) => stream.forward_to(sink),
                None => stream,
            })
        })
    }

    fn cancel_reservation(&self, reservation: RequestId) -> BoxFuture<bool> {
        let r = self.free_if(reservation.0, |s| matches!(s, Slot::Reserved(_)));
        Box::pin(async move { r })
    }

    fn prefix_changes(&self, snapshot: bool) -> BoxFuture<Option<flotilla_proto::PrefixChanges>> {
        let mut c = self.0.cache.lock().unwrap();
        let changes = if snapshot {
            flotilla_proto::PrefixChanges {
                full: true,
                stored: c.0.iter().copied().collect(),
                removed: Vec::new(),
            }
        } else {
            flotilla_proto::PrefixChanges {
                full: false,
                stored: std::mem::take(&mut c.1),
                removed: Vec::new(),
            }
        };
        Box::pin(async move { Some(changes) })
    }

    fn kv_holders(&self) -> BoxFuture<Vec<RequestId>> {
        let ids = self
            .0
            .slots
            .lock()
            .unwrap()
            .keys()
            .map(|&k| RequestId(k))
            .collect();
        Box::pin(async move { ids })
    }

    fn drop_orphan(&self, id: RequestId) -> BoxFuture<bool> {
        self.0.orphans_dropped.fetch_add(1, Ordering::SeqCst);
        let r = self.free_if(id.0, |_| true);
        Box::pin(async move { r })
    }
}

struct Rig {
    net: Arc<SimNet>,
    router: ClusterEngine,
    /// Node `i + 1`'s engine.
    engines: Vec<FakePd>,
}

pub(crate) fn opts(role: Role) -> NodeSettings {
    NodeSettings {
        model: "fake".into(),
        reservation_ttl: TTL,
        hold_ttl: TTL,
        ..crate::testrig::node_opts(HB, DOWN, role)
    }
}

fn start(net: &Arc<SimNet>, node: NodeId, epoch: u64, role: Role, e: &FakePd) {
    start_with(net, node, epoch, e, opts(role));
}

pub(crate) fn start_with(net: &Arc<SimNet>, node: NodeId, epoch: u64, e: &FakePd, o: NodeSettings) {
    let kv: Arc<dyn KvMigration> = Arc::new(e.clone());
    let o = WorkerOptions::new(o);
    let connect = crate::testrig::connect(net, node, epoch);
    tokio::spawn(run_worker(connect, Arc::new(e.clone()), Some(kv), o));
}

/// Router at node 0, then one node per role, each with a 1000-block cache.
async fn rig(roles: &[Role]) -> Rig {
    rig_with(roles, |o| o).await
}

/// [`rig`] with the nodes' options changed by `f`.
async fn rig_with(roles: &[Role], f: impl Fn(NodeSettings) -> NodeSettings) -> Rig {
    let net = net(roles);
    let router = start_router(&net, roles, BS as usize, HB, DOWN).await;
    let engines: Vec<FakePd> = roles.iter().map(|_| FakePd::new(1000)).collect();
    for (i, r) in roles.iter().enumerate() {
        start_with(&net, i as NodeId + 1, 1, &engines[i], f(opts(*r)));
    }
    wait_up(&router, roles.len()).await;
    Rig {
        net,
        router,
        engines,
    }
}

pub(crate) fn req(prompt_len: u32, max_tokens: u32, tag: u32) -> EngineRequest {
    EngineRequest {
        tenant: TenantId(0),
        prompt: (0..prompt_len).map(|i| i * 3 + tag).collect(),
        max_tokens,
        sampling: SamplingParams::default(),
        logit_bias: Vec::new(),
        generated: 0,
        constraint: None,
        ignore_eos: false,
        stop_token_ids: vec![],
        speculative: true,
        trace: None,
    }
}

pub(crate) fn expected(r: &EngineRequest) -> Vec<u32> {
    (0..r.max_tokens).map(|k| tok(&r.prompt, k)).collect()
}

/// Waits until no engine of the rig holds a block.
async fn all_blocks_back(r: &Rig) {
    crate::testrig::no_frame_refused(&r.net);
    for _ in 0..400 {
        if r.engines.iter().all(|e| e.used() == 0) {
            return;
        }
        pass(Duration::from_millis(5)).await;
    }
    let used: Vec<u32> = r.engines.iter().map(|e| e.used()).collect();
    panic!("blocks still used per node: {used:?}");
}

#[tokio::test(start_paused = true)]
async fn a_disaggregated_request_continues_from_the_prefill_nodes_state() {
    let r = rig(&[Role::Prefill, Role::Decode]).await;
    for i in 0..4 {
        let q = req(10 + i, 12, i);
        let (toks, end) = drain(r.router.submit(q.clone()).await.unwrap()).await;
        assert_eq!(toks, expected(&q), "request {i}");
        assert!(matches!(end, EngineEvent::Finished { .. }), "{end:?}");
    }
    let (p, d) = (&r.engines[0].0, &r.engines[1].0);
    assert_eq!(p.prefills.load(Ordering::SeqCst), 4);
    assert_eq!(p.exports.load(Ordering::SeqCst), 4);
    assert_eq!(d.imports.load(Ordering::SeqCst), 4);
    all_blocks_back(&r).await;
}

#[tokio::test(start_paused = true)]
async fn a_full_decode_node_is_skipped_and_all_full_is_a_clear_refusal() {
    let r = rig(&[Role::Prefill, Role::Decode, Role::Decode]).await;
    r.engines[1].0.refuse_reserve.store(true, Ordering::SeqCst);
    for i in 0..4 {
        let q = req(9, 5, i);
        let (toks, _) = drain(r.router.submit(q.clone()).await.unwrap()).await;
        assert_eq!(toks, expected(&q));
    }
    assert_eq!(r.engines[1].0.imports.load(Ordering::SeqCst), 0);
    assert_eq!(r.engines[2].0.imports.load(Ordering::SeqCst), 4);
    r.engines[2].0.refuse_reserve.store(true, Ordering::SeqCst);
    let e = r.router.submit(req(9, 5, 9)).await.unwrap_err();
    assert_eq!(e, Rejection::Unavailable);
    all_blocks_back(&r).await;
}

#[tokio::test(start_paused = true)]
async fn a_client_gone_during_prefill_frees_both_sides() {
    let r = rig(&[Role::Prefill, Role::Decode]).await;
    r.engines[0].0.prefill_ms.store(200, Ordering::SeqCst);
    let s = r.router.submit(req(30, 8, 1)).await.unwrap();
    until("the prefill to start", || r.engines[0].used() > 0).await;
    assert!(r.engines[1].used() > 0, "the decode side reserved nothing");
    drop(s);
    all_blocks_back(&r).await;
    pass(Duration::from_millis(250)).await;
    assert_eq!(r.engines[0].0.exports.load(Ordering::SeqCst), 0);
    all_blocks_back(&r).await;
}

#[tokio::test(start_paused = true)]
async fn a_client_gone_during_the_transfer_frees_both_sides() {
    let r = rig(&[Role::Prefill, Role::Decode]).await;
    r.engines[1].0.import_ms.store(150, Ordering::SeqCst);
    let s = r.router.submit(req(30, 8, 2)).await.unwrap();
    until("the export", || {
        r.engines[0].0.exports.load(Ordering::SeqCst) == 1
    })
    .await;
    drop(s);
    // The import completes into a cancelled request: its stream is
    // dropped, and the prefill side gets its ack and frees its blocks.
    all_blocks_back(&r).await;
    assert_eq!(r.engines[1].0.imports.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn a_client_gone_during_decode_frees_both_sides() {
    let r = rig(&[Role::Prefill, Role::Decode]).await;
    let mut s = r.router.submit(req(12, 400, 3)).await.unwrap();
    for _ in 0..3 {
        assert!(matches!(s.recv().await, Some(EngineEvent::Token(_))));
    }
    drop(s);
    all_blocks_back(&r).await;
}

#[tokio::test(start_paused = true)]
async fn a_reservation_past_its_deadline_is_freed_and_the_request_runs_colocated() {
    let r = rig(&[Role::Prefill, Role::Decode]).await;
    // The prefill takes longer than the reservation lives.
    r.engines[0].0.prefill_ms.store(700, Ordering::SeqCst);
    let q = req(20, 6, 4);
    let (toks, end) = drain(r.router.submit(q.clone()).await.unwrap()).await;
    assert_eq!(toks, expected(&q));
    assert!(matches!(end, EngineEvent::Finished { .. }));
    // It ran whole on the decode node; the cancelled prefill never exported.
    assert_eq!(r.engines[1].0.imports.load(Ordering::SeqCst), 0);
    pass(Duration::from_millis(800)).await;
    assert_eq!(r.engines[0].0.exports.load(Ordering::SeqCst), 0);
    all_blocks_back(&r).await;
}

#[tokio::test(start_paused = true)]
async fn a_prefill_node_that_dies_mid_transfer_is_replaced() {
    let r = rig(&[Role::Prefill, Role::Prefill, Role::Decode]).await;
    r.engines[0].0.prefill_ms.store(5_000, Ordering::SeqCst);
    r.engines[1].0.prefill_ms.store(5_000, Ordering::SeqCst);
    let q = req(16, 6, 5);
    let s = r.router.submit(q.clone()).await.unwrap();
    until("a prefill", || {
        r.engines[0].used() + r.engines[1].used() > 0
    })
    .await;
    let (dead, alive) = if r.engines[0].used() > 0 {
        (0, 1)
    } else {
        (1, 0)
    };
    r.engines[alive].0.prefill_ms.store(0, Ordering::SeqCst);
    r.net.crash(dead as NodeId + 1);
    let (toks, end) = drain(s).await;
    assert_eq!(toks, expected(&q));
    assert!(matches!(end, EngineEvent::Finished { .. }));
    assert_eq!(r.engines[alive].0.exports.load(Ordering::SeqCst), 1);
    // The dead node's memory is gone with it; the others hold nothing.
    for i in [alive, 2] {
        until("blocks back", || r.engines[i].used() == 0).await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_decode_node_lost_after_its_kv_arrived_frees_the_prefill_side_at_once() {
    // Holds that would last a minute: only the Router's abandon frees
    // them within the test's wait.
    let long = |o: NodeSettings| NodeSettings {
        hold_ttl: Duration::from_secs(60),
        ..o
    };
    let r = rig_with(&[Role::Prefill, Role::Decode, Role::Decode], long).await;
    // The KV reaches a decode node, which dies writing it: no ack ever.
    r.engines[1].0.import_ms.store(5_000, Ordering::SeqCst);
    r.engines[2].0.import_ms.store(5_000, Ordering::SeqCst);
    let q = req(16, 6, 7);
    let s = r.router.submit(q.clone()).await.unwrap();
    until("the export", || {
        r.engines[0].0.exports.load(Ordering::SeqCst) == 1
    })
    .await;
    let (dead, alive) = if r.engines[1].used() > 0 {
        (1, 2)
    } else {
        (2, 1)
    };
    r.engines[alive].0.import_ms.store(0, Ordering::SeqCst);
    r.net.crash(dead as NodeId + 1);
    let (toks, end) = drain(s).await;
    assert_eq!(toks, expected(&q));
    assert!(matches!(end, EngineEvent::Finished { .. }));
    // No token had been sent: it ran again on the other decode node. Both
    // prefills (the first for the dead node, the re-run's) are back within
    // ~2 s, not after the 60 s hold.
    assert_eq!(r.engines[0].0.exports.load(Ordering::SeqCst), 2);
    for i in [0, alive] {
        until("blocks back", || r.engines[i].used() == 0).await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_lease_no_request_owns_is_found_and_given_back() {
    let quick = |o: NodeSettings| NodeSettings {
        reconcile_interval: HB * 2,
        ..o
    };
    let r = rig_with(&[Role::Prefill, Role::Decode], quick).await;
    // A request served normally leaves nothing behind ...
    let q = req(12, 4, 3);
    let (toks, _) = drain(r.router.submit(q.clone()).await.unwrap()).await;
    assert_eq!(toks, expected(&q));
    all_blocks_back(&r).await;
    // ... then a reservation that no request of the node knows (a leak).
    let d = &r.engines[1];
    d.take(5).unwrap();
    d.0.slots.lock().unwrap().insert(999, Slot::Reserved(5));
    assert_eq!(d.used(), 5);
    until("the orphan given back", || d.used() == 0).await;
    assert_eq!(d.0.orphans_dropped.load(Ordering::SeqCst), 1);
    assert_eq!(r.engines[0].0.orphans_dropped.load(Ordering::SeqCst), 0);
    // The decode node says so in its load report, shown in /ready.
    for _ in 0..400 {
        let s = r.router.status().await;
        if s.nodes
            .iter()
            .any(|n| n.name == "decode-2" && n.kv_orphans == 1)
        {
            return;
        }
        pass(Duration::from_millis(5)).await;
    }
    panic!("the Router never showed decode-2's orphan");
}

#[tokio::test(start_paused = true)]
async fn a_decode_node_that_dies_mid_stream_with_no_other_ends_the_stream_after_a_wait() {
    let r = rig(&[Role::Prefill, Role::Decode]).await;
    let mut s = r.router.submit(req(12, 900, 7)).await.unwrap();
    for _ in 0..3 {
        assert!(matches!(s.recv().await, Some(EngineEvent::Token(_))));
    }
    r.net.crash(2);
    let killed = tokio::time::Instant::now();
    // No other decode node: the stream waits for one (the down bound
    // three times, and 5 s), then ends with the reason.
    let end = tokio::time::timeout(Duration::from_secs(30), s.recv())
        .await
        .expect("the stream hung")
        .expect("a terminal event");
    assert!(
        killed.elapsed() >= Duration::from_secs(5),
        "{:?}",
        killed.elapsed()
    );
    match end {
        EngineEvent::Failed(EngineFailure::Internal(m)) => {
            assert!(
                m.contains("stopped responding") && m.contains("none could within"),
                "{m}"
            )
        }
        e => panic!("{e:?}"),
    }
    until("prefill blocks back", || r.engines[0].used() == 0).await;
}

#[tokio::test(start_paused = true)]
async fn kv_for_another_model_is_refused_and_the_request_runs_colocated() {
    let net = net(&[Role::Prefill, Role::Decode]);
    let router = start_router(&net, &[Role::Prefill, Role::Decode], BS as usize, HB, DOWN).await;
    let (p, d) = (FakePd::new(1000), FakePd::new(1000));
    start(&net, 1, 1, Role::Prefill, &p);
    let kv: Arc<dyn KvMigration> = Arc::new(d.clone());
    let mut o = opts(Role::Decode);
    o.model = "another".into();
    tokio::spawn(run_worker(
        crate::testrig::connect(&net, 2, 1),
        Arc::new(d.clone()),
        Some(kv),
        WorkerOptions::new(o),
    ));
    wait_up(&router, 2).await;
    let q = req(10, 5, 8);
    let (toks, _) = drain(router.submit(q.clone()).await.unwrap()).await;
    assert_eq!(toks, expected(&q));
    assert_eq!(p.0.exports.load(Ordering::SeqCst), 1);
    assert_eq!(d.0.imports.load(Ordering::SeqCst), 0);
    until("blocks back", || p.used() == 0 && d.used() == 0).await;
}

#[tokio::test(start_paused = true)]
async fn many_requests_with_cancellations_and_a_killed_node_leak_no_blocks() {
    let r = rig(&[Role::Prefill, Role::Prefill, Role::Decode, Role::Decode]).await;
    let mut handles = Vec::new();
    for i in 0..200u32 {
        let router = r.router.clone();
        handles.push(tokio::spawn(async move {
            let Ok(mut s) = router.submit(req(5 + i % 20, 3 + i % 9, i)).await else {
                return;
            };
            // A third of the clients leave after a token or two.
            let keep = if i % 3 == 0 { 1 + i % 2 } else { u32::MAX };
            let mut got = 0;
            while let Ok(Some(ev)) = tokio::time::timeout(Duration::from_secs(5), s.recv()).await {
                if !matches!(ev, EngineEvent::Token(_)) {
                    break;
                }
                got += 1;
                if got >= keep {
                    break;
                }
            }
        }));
        if i == 100 {
            r.net.crash(1);
        }
        pass(Duration::from_millis(1)).await;
    }
    for h in handles {
        h.await.unwrap();
    }
    for i in 1..4 {
        until("blocks back", || r.engines[i].used() == 0).await;
    }
}

/// Every input each core handled in a cluster run (P/D requests, a
/// client gone mid-stream, heartbeats, ticks), recorded by the shells and
/// fed to a fresh core: the same outputs, step by step. The cores' inputs
/// (time, messages, engine answers, reachability) describe a run whole.
#[tokio::test(start_paused = true)]
async fn a_recorded_cluster_run_replays_each_core_to_the_same_outputs() {
    let roles = [Role::Prefill, Role::Decode];
    let net = net(&roles);
    let router_rec = Recorder::<RouterStep>::default();
    let hooks = RouterHooks {
        check: None,
        record: Some(router_rec.clone()),
    };
    let ropts = router_opts(&roles, BS as usize, HB, DOWN);
    let router = start_router_with(&net, ropts.clone(), hooks).await;
    let engines: Vec<FakePd> = roles.iter().map(|_| FakePd::new(1000)).collect();
    let mut node_recs = Vec::new();
    for (i, role) in roles.iter().enumerate() {
        let rec = Recorder::<NodeStep>::default();
        let connect = crate::testrig::connect(&net, i as NodeId + 1, 1);
        let kv: Arc<dyn KvMigration> = Arc::new(engines[i].clone());
        let o = WorkerOptions {
            record: Some(rec.clone()),
            ..WorkerOptions::new(opts(*role))
        };
        tokio::spawn(run_worker(
            connect,
            Arc::new(engines[i].clone()),
            Some(kv),
            o,
        ));
        node_recs.push(rec);
    }
    wait_up(&router, roles.len()).await;
    for i in 0..3 {
        let q = req(10 + i, 6, i);
        let (toks, _) = drain(router.submit(q.clone()).await.unwrap()).await;
        assert_eq!(toks, expected(&q));
    }
    let mut s = router.submit(req(12, 40, 9)).await.unwrap();
    let _ = s.recv().await;
    drop(s);
    for _ in 0..400 {
        if engines.iter().all(|e| e.used() == 0) {
            break;
        }
        pass(Duration::from_millis(5)).await;
    }
    // Stop the Router (and with it the recording) before reading.
    drop(router);
    pass(HB).await;

    let steps = router_rec.take();
    let submits = steps
        .iter()
        .filter(|s| matches!(s.input, RouterInput::Submit { .. }))
        .count();
    let gone = steps
        .iter()
        .filter(|s| matches!(s.input, RouterInput::ClientGone { .. }))
        .count();
    // Every stream's drop tells the Router, finished or not.
    assert_eq!((submits, gone), (4, 4), "the run the test made");
    let mut core = RouterCore::new(ropts, Duration::ZERO);
    for (i, s) in steps.into_iter().enumerate() {
        let mut out = Vec::new();
        core.handle(s.now, s.input.clone(), &s.reach, &mut out);
        // As text: a logprob may be NaN, which equals nothing.
        let (got, recorded) = (format!("{out:?}"), format!("{:?}", s.outputs));
        assert_eq!(got, recorded, "router step {i}: {:?}", s.input);
    }
    for (i, role) in roles.iter().enumerate() {
        let steps = node_recs[i].take();
        assert!(steps.len() > 10, "node {} handled {}", i + 1, steps.len());
        let layout = Some(engines[i].kv_layout());
        let mut core = NodeCore::new(opts(*role), i as NodeId + 1, 1, layout, Duration::ZERO);
        for (k, s) in steps.into_iter().enumerate() {
            let mut out = Vec::new();
            core.handle(s.now, s.input.clone(), &mut out);
            let (got, recorded) = (format!("{out:?}"), format!("{:?}", s.outputs));
            assert_eq!(got, recorded, "node {} step {k}: {:?}", i + 1, s.input);
        }
    }
}
