//! Router and worker bridge over the simulated network, with a fake
//! engine: routing, membership, re-runs, epochs and cleanup.

// Tests spawn nodes on the runtime (on a paused clock: see `testrig`).
#![allow(clippy::disallowed_methods)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flotilla_engine::{BoxFuture, Engine, RequestStream};
use flotilla_proto::{
    DrainRefusal, EngineEvent, EngineRequest, EngineStatus, FinishReason, KvUsage, Rejection,
    RequestId, Role, Sampled, SamplingParams, TenantId, Usage,
};
use tokio::sync::mpsc;

use crate::testrig::{self, pass, start_router, wait_up};
use crate::{ClusterEngine, WorkerOptions, run_worker};
use flotilla_transport::sim::SimNet;

const HB: Duration = Duration::from_millis(20);
const DOWN: Duration = Duration::from_millis(60);

/// Emits `max_tokens` tokens, one every 5 ms, after `prompt[0]` ms; counts
/// live requests (dropped streams give theirs back).
#[derive(Default)]
struct FakeEngine {
    /// Ignore `prompt[0]`: start at once.
    eager: bool,
    live: Arc<AtomicUsize>,
    seen: Mutex<Vec<u64>>,
    next: AtomicUsize,
}

impl Engine for FakeEngine {
    fn submit(&self, req: EngineRequest) -> BoxFuture<Result<RequestStream, Rejection>> {
        let live = self.live.clone();
        let eager = self.eager;
        let id = self.next.fetch_add(1, Ordering::Relaxed) as u64;
        self.seen.lock().unwrap().push(req.sampling.seed);
        Box::pin(async move {
            let (tx, rx) = mpsc::unbounded_channel();
            live.fetch_add(1, Ordering::SeqCst);
            let l2 = live.clone();
            let first = Duration::from_millis(if eager { 0 } else { req.prompt[0] as u64 });
            tokio::spawn(async move {
                pass(first).await;
                for i in 0..req.max_tokens {
                    pass(Duration::from_millis(5)).await;
                    let t = Sampled {
                        token: i,
                        logprob: f32::NAN,
                        top: vec![],
                    };
                    if tx.send(EngineEvent::Token(t)).is_err() {
                        return;
                    }
                }
                let usage = Usage {
                    prompt_tokens: req.prompt.len() as u32,
                    completion_tokens: req.max_tokens,
                    cached_tokens: 0,
                };
                let _ = tx.send(EngineEvent::Finished {
                    reason: FinishReason::Length,
                    usage,
                });
            });
            Ok(RequestStream::new(
                RequestId(id),
                rx,
                Box::new(move |_| {
                    l2.fetch_sub(1, Ordering::SeqCst);
                }),
            ))
        })
    }

    fn status(&self) -> BoxFuture<EngineStatus> {
        Box::pin(async {
            EngineStatus {
                ready: true,
                kv: KvUsage {
                    total: 100_000,
                    free: 100_000,
                    used: 0,
                    cached: 0,
                    ..KvUsage::default()
                },
                ..EngineStatus::default()
            }
        })
    }
}

struct Rig {
    net: Arc<SimNet>,
    router: ClusterEngine,
    engines: Vec<Arc<FakeEngine>>,
}

fn worker_opts() -> WorkerOptions {
    WorkerOptions::new(testrig::node_opts(HB, DOWN, Role::Worker))
}

fn start_worker(net: &Arc<SimNet>, node: u32, epoch: u64) -> Arc<FakeEngine> {
    start_engine(net, node, epoch, FakeEngine::default())
}

fn start_engine(net: &Arc<SimNet>, node: u32, epoch: u64, e: FakeEngine) -> Arc<FakeEngine> {
    let e = Arc::new(e);
    let connect = testrig::connect(net, node, epoch);
    tokio::spawn(run_worker(connect, e.clone(), None, worker_opts()));
    e
}

async fn rig(workers: usize) -> Rig {
    rig_with(workers, workers).await
}

/// A Router that knows `workers` engine nodes, of which the first `started` run.
async fn rig_with(workers: usize, started: usize) -> Rig {
    let net = testrig::net(&vec![Role::Worker; workers]);
    let router = start_router(&net, &vec![Role::Worker; workers], 4, HB, DOWN).await;
    let engines = (1..=started as u32)
        .map(|n| start_worker(&net, n, 1))
        .collect();
    let r = Rig {
        net,
        router,
        engines,
    };
    wait_up(&r.router, started).await;
    r
}

fn req(first_token_ms: u32, prompt_len: usize, max_tokens: u32, tag: u64) -> EngineRequest {
    let mut prompt: Vec<u32> = (0..prompt_len as u32).map(|i| i + 100).collect();
    prompt[0] = first_token_ms;
    EngineRequest {
        tenant: TenantId(0),
        prompt,
        max_tokens,
        sampling: SamplingParams {
            seed: tag,
            ..SamplingParams::default()
        },
        logit_bias: Vec::new(),
        generated: 0,
        constraint: None,
        ignore_eos: false,
        stop_token_ids: vec![],
        speculative: true,
        trace: None,
    }
}

/// Reads a stream to its end: (token count, terminal event).
async fn drain(s: RequestStream) -> (u32, EngineEvent) {
    let (toks, end) = testrig::drain(s).await;
    (toks.len() as u32, end)
}

async fn routed(r: &Rig) -> Vec<u64> {
    let s = r.router.status().await;
    s.nodes.iter().map(|n| n.routed).collect()
}

#[tokio::test(start_paused = true)]
async fn requests_stream_from_both_workers() {
    let r = rig(2).await;
    let mut streams = Vec::new();
    for i in 0..8 {
        // Distinct prompts: no prefix affinity, so load spreads them.
        let mut q = req(0, 8, 6, i);
        q.prompt[1] = 1000 + i as u32;
        streams.push(r.router.submit(q).await.unwrap());
    }
    for s in streams {
        let (n, end) = drain(s).await;
        assert_eq!(n, 6);
        assert!(matches!(end, EngineEvent::Finished { usage, .. } if usage.completion_tokens == 6));
    }
    let by = routed(&r).await;
    assert_eq!(by.iter().sum::<u64>(), 8);
    assert!(by.iter().all(|&n| n >= 2), "load did not spread: {by:?}");
    for e in &r.engines {
        assert_eq!(
            e.live.load(Ordering::SeqCst),
            0,
            "a finished request is still live"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_cached_prefix_wins_unless_its_worker_is_much_busier() {
    let r = rig(2).await;
    let first = r.router.submit(req(0, 32, 2, 0)).await.unwrap();
    drain(first).await;
    let home = routed(&r).await.iter().position(|&n| n == 1).unwrap();
    for i in 1..4 {
        let s = r.router.submit(req(0, 36, 2, i)).await.unwrap();
        drain(s).await;
    }
    assert_eq!(
        routed(&r).await[home],
        4,
        "shared-prefix requests left the worker holding it"
    );
    // Long same-prefix requests that stay in flight: the first still goes
    // home (one block to compute there, nine elsewhere), but its running KV
    // (19 blocks) then outweighs the cached prefix and the next one goes to
    // the idle worker.
    let mut busy = Vec::new();
    let mut went = Vec::new();
    for i in 0..3 {
        let before = routed(&r).await;
        busy.push(r.router.submit(req(0, 36, 4000, 100 + i)).await.unwrap());
        let after = routed(&r).await;
        went.push((0..2).find(|&w| after[w] > before[w]).unwrap());
    }
    assert_eq!(
        went[0], home,
        "a cached prefix on an idle worker lost: {went:?}"
    );
    assert!(
        went[1..].contains(&(1 - home)),
        "a busy worker kept all work: {went:?}"
    );
    drop(busy);
}

#[tokio::test(start_paused = true)]
async fn a_dead_worker_is_marked_down_and_its_requests_move_or_rerun() {
    // The second worker starts later, so the first takes both requests.
    let r = rig_with(2, 1).await;
    let streaming = r.router.submit(req(0, 8, 400, 1)).await.unwrap();
    let waiting = r.router.submit(req(10_000, 8, 3, 2)).await.unwrap();
    let mut streaming = streaming;
    assert!(matches!(
        streaming.recv().await,
        Some(EngineEvent::Token(_))
    ));
    let net2 = r.net.clone();
    let eager = FakeEngine {
        eager: true,
        ..FakeEngine::default()
    };
    let _e2 = start_engine(&net2, 2, 1, eager);
    r.net.crash(1);
    // The streaming one moves to worker-2 with the tokens it had sent:
    // the client sees a pause, then the rest, every token once.
    let (n, end) = drain(streaming).await;
    match end {
        EngineEvent::Finished { usage, .. } => {
            assert_eq!((usage.prompt_tokens, usage.completion_tokens), (8, 400));
        }
        e => panic!("a request whose node died should move and finish, got {e:?}"),
    }
    assert_eq!(n + 1, 400, "a token lost or sent twice");
    // The one with no token yet moved to worker-2 and completes there.
    let (n, end) = drain(waiting).await;
    assert!(matches!(end, EngineEvent::Finished { .. }), "{end:?}");
    assert_eq!(n, 3);
    let s = r.router.status().await;
    assert!(!s.nodes[0].up && s.nodes[0].downs == 1, "{:?}", s.nodes);
    // New work goes to the live worker.
    let (n, _) = drain(r.router.submit(req(0, 8, 2, 3)).await.unwrap()).await;
    assert_eq!(n, 2);
}

#[tokio::test(start_paused = true)]
async fn a_restarted_worker_rejoins_with_a_new_epoch_and_takes_work() {
    let r = rig(2).await;
    r.net.crash(1);
    for _ in 0..100 {
        if r.router.up_nodes().await == ["worker-2"] {
            break;
        }
        pass(Duration::from_millis(5)).await;
    }
    assert_eq!(r.router.up_nodes().await, ["worker-2"]);
    let e1 = start_worker(&r.net, 1, 2);
    wait_up(&r.router, 2).await;
    let s = r.router.status().await;
    assert_eq!(s.nodes[0].epoch, 2);
    for i in 0..4 {
        let mut q = req(0, 8, 2, i);
        q.prompt[1] = 5000 + i as u32;
        drain(r.router.submit(q).await.unwrap()).await;
    }
    assert!(
        !e1.seen.lock().unwrap().is_empty(),
        "the rejoined worker took no work"
    );
}

#[tokio::test(start_paused = true)]
async fn a_dropped_stream_frees_the_request_on_its_worker() {
    let r = rig(1).await;
    let mut s = r.router.submit(req(0, 8, 10_000, 1)).await.unwrap();
    assert!(matches!(s.recv().await, Some(EngineEvent::Token(_))));
    assert_eq!(r.engines[0].live.load(Ordering::SeqCst), 1);
    drop(s);
    for _ in 0..100 {
        if r.engines[0].live.load(Ordering::SeqCst) == 0 {
            return;
        }
        pass(Duration::from_millis(5)).await;
    }
    panic!("the worker kept the cancelled request");
}

#[tokio::test(start_paused = true)]
async fn a_silent_router_gets_its_requests_cancelled_on_the_workers() {
    let r = rig(1).await;
    let mut s = r.router.submit(req(0, 8, 10_000, 1)).await.unwrap();
    assert!(matches!(s.recv().await, Some(EngineEvent::Token(_))));
    r.net.crash(0);
    for _ in 0..100 {
        if r.engines[0].live.load(Ordering::SeqCst) == 0 {
            return;
        }
        pass(Duration::from_millis(5)).await;
    }
    panic!("the worker kept a dead router's request");
}

#[tokio::test(start_paused = true)]
async fn no_worker_up_is_a_refusal_not_a_hang() {
    let net = testrig::net(&[Role::Worker]);
    let router = start_router(&net, &[Role::Worker], 4, HB, DOWN).await;
    assert!(matches!(
        router.submit(req(0, 4, 1, 0)).await,
        Err(Rejection::Unavailable)
    ));
    assert!(!router.status().await.ready);
}

#[tokio::test(start_paused = true)]
async fn an_operator_s_drain_reaches_the_node_which_leaves_and_its_stream_moves() {
    let r = rig(2).await;
    let refused = r.router.drain_node("worker-9", Duration::ZERO).await;
    assert!(
        matches!(&refused, Err(DrainRefusal::UnknownNode { nodes, .. }) if nodes.len() == 2),
        "{refused:?}"
    );
    let mut s = r.router.submit(req(0, 8, 400, 1)).await.unwrap();
    assert!(matches!(s.recv().await, Some(EngineEvent::Token(_))));
    let st = r.router.status().await;
    let on = st.nodes.iter().position(|n| n.in_flight == 1).unwrap();
    let name = st.nodes[on].name.clone();
    // No grace: what runs there moves at once.
    r.router.drain_node(&name, Duration::ZERO).await.unwrap();
    let (n, end) = drain(s).await;
    assert!(matches!(end, EngineEvent::Finished { .. }), "{end:?}");
    assert_eq!(n + 1, 400, "a token lost or sent twice");
    let st = r.router.status().await;
    let node = &st.nodes[on];
    assert_eq!(
        (node.up, node.downs, node.moved_away),
        (false, 0, 1),
        "{node:?}"
    );
    assert_eq!(
        r.router.drain_node(&name, Duration::ZERO).await,
        Err(DrainRefusal::NotUp(name))
    );
}
