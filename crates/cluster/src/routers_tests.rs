//! Two Routers over one pair of workers (the simulated network, the fake
//! engine with real block accounting of `pd_tests`): both place on every
//! worker, one's death touches none of the other's requests and frees
//! its own requests' blocks within the down bound, and a restarted Router
//! has the workers' prefix caches again from their snapshots.

// Tests spawn nodes on the runtime (on a paused clock: see `testrig`).
#![allow(clippy::disallowed_methods)]

use std::sync::Arc;
use std::time::Duration;

use flotilla_engine::{Engine, RequestStream};
use flotilla_exec::rng::Rng;
use flotilla_proto::{EngineEvent, EngineRequest, Role};
use flotilla_transport::sim::{LinkConfig, SimNet};

use crate::pd_tests::{BS, DOWN, FakePd, HB, expected, opts, req, start_with};
use crate::testrig::{connect, no_frame_refused, pass, router_opts, until, wait_up};
use crate::{ClusterEngine, NodeSettings, RouterHooks, RouterOptions};

/// Router A at node 0, workers 1 and 2 (each admitting from both
/// Routers), Router B at node 3.
struct Two {
    net: Arc<SimNet>,
    engines: [FakePd; 2],
    ropts: RouterOptions,
}

fn two() -> Two {
    let roles = vec![Role::Router, Role::Worker, Role::Worker, Role::Router];
    let link = LinkConfig {
        idle_timeout_ms: 300,
        ..LinkConfig::default()
    };
    let net = SimNet::new(roles, link, Rng::new(3));
    let engines = [FakePd::new(1000), FakePd::new(1000)];
    for (i, e) in engines.iter().enumerate() {
        let o = NodeSettings {
            routers: vec![0, 3],
            ..opts(Role::Worker)
        };
        start_with(&net, i as u32 + 1, 1, e, o);
    }
    Two {
        net,
        engines,
        ropts: router_opts(&[Role::Worker, Role::Worker], BS as usize, HB, DOWN),
    }
}

async fn router(t: &Two, node: u32, epoch: u64) -> ClusterEngine {
    let r = ClusterEngine::start_with(
        connect(&t.net, node, epoch),
        t.ropts.clone(),
        RouterHooks::default(),
    )
    .await
    .expect("router starts");
    wait_up(&r, 2).await;
    r
}

/// A stream to its end: its tokens and its terminal event (None: it broke
/// off, as a client of a dead front sees it).
async fn read(mut s: RequestStream) -> (Vec<u32>, Option<EngineEvent>) {
    let mut toks = Vec::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(5), s.recv()).await {
            Ok(Some(EngineEvent::Token(t))) => toks.push(t.token),
            Ok(Some(end)) => return (toks, Some(end)),
            Ok(None) => return (toks, None),
            Err(_) => panic!("stream stalled"),
        }
    }
}

fn used(t: &Two) -> u32 {
    t.engines.iter().map(|e| e.used()).sum()
}

#[tokio::test(start_paused = true)]
async fn two_routers_share_the_workers_and_one_s_death_spares_the_other_s_streams() {
    let t = two();
    let a = router(&t, 0, 1).await;
    let b = router(&t, 3, 1).await;
    // 16 streams on each: B's short, A's long enough to be cut.
    let mut b_runs = Vec::new();
    for i in 0..16u32 {
        let b = b.clone();
        b_runs.push(tokio::spawn(async move {
            let q = req(8 + i % 5, 20, 100 + i);
            let s = b.submit(q.clone()).await.expect("B admits");
            (q, read(s).await)
        }));
    }
    let mut a_streams = Vec::new();
    for i in 0..16u32 {
        a_streams.push(a.submit(req(8 + i % 5, 200, i)).await.expect("A admits"));
    }
    pass(Duration::from_millis(10)).await;
    // Both Routers placed on both workers.
    let ran: Vec<usize> = t.engines.iter().map(|e| e.prompts().len()).collect();
    assert!(
        ran.iter().all(|&n| n > 0),
        "every worker runs requests: {ran:?}"
    );
    assert!(used(&t) > 0);
    // A dies (SIGKILL): its socket and its process are gone at once.
    t.net.crash(0);
    drop(a);
    let died = tokio::time::Instant::now();
    for s in a_streams {
        let (toks, end) = read(s).await;
        assert!(end.is_none(), "a dead front's stream breaks off: {end:?}");
        assert!(toks.len() < 200);
    }
    // B's streams: every one whole, none with an error.
    for run in b_runs {
        let (q, (toks, end)) = run.await.unwrap();
        assert_eq!(toks, expected(&q));
        assert!(
            matches!(end, Some(EngineEvent::Finished { .. })),
            "B's request ended with {end:?}"
        );
    }
    // The workers give back A's requests' blocks when A has been silent
    // past the down bound (B's finished meanwhile).
    until("A's blocks back", || used(&t) == 0).await;
    let took = died.elapsed();
    assert!(
        took <= DOWN + HB * 2,
        "A's blocks held {took:?} after its death (down bound {DOWN:?})"
    );
    no_frame_refused(&t.net);
    drop(b);
}

/// A restarted Router gets each worker's prefix cache whole when the
/// worker hears its new life, so its first placements find the prefixes
/// another Router's requests left, before it has placed anything.
#[tokio::test(start_paused = true)]
async fn a_restarted_router_places_with_the_workers_caches_at_once() {
    let t = two();
    let a = router(&t, 0, 1).await;
    let b = router(&t, 3, 1).await;
    let mut runs = Vec::new();
    for i in 0..8u32 {
        let b = b.clone();
        runs.push(tokio::spawn(async move {
            let q = req(12, 3, 40 * i);
            read(b.submit(q).await.unwrap()).await
        }));
    }
    for r in runs {
        let (_, end) = r.await.unwrap();
        assert!(matches!(end, Some(EngineEvent::Finished { .. })));
    }
    t.net.crash(0);
    drop(a);
    pass(DOWN * 2).await;
    let a = ClusterEngine::start_with(
        connect(&t.net, 0, 2),
        t.ropts.clone(),
        RouterHooks::default(),
    )
    .await
    .unwrap();
    let started = tokio::time::Instant::now();
    // Each worker hears the new life and sends its cache whole.
    let mut snapshots = 0;
    for _ in 0..400 {
        snapshots = a.status().await.routing.prefix_snapshots;
        if snapshots == 2 {
            break;
        }
        pass(Duration::from_millis(5)).await;
    }
    assert_eq!(snapshots, 2, "one snapshot from each worker");
    assert!(
        started.elapsed() <= HB * 3,
        "the view came back in {:?}",
        started.elapsed()
    );
    // Every prompt B ran: A places it where it ran, with a candidate.
    for (w, e) in t.engines.iter().enumerate() {
        for prompt in e.prompts() {
            let q = EngineRequest {
                prompt: prompt.clone(),
                ..req(12, 2, 0)
            };
            let (_, end) = read(a.submit(q).await.unwrap()).await;
            assert!(matches!(end, Some(EngineEvent::Finished { .. })));
            assert_eq!(
                t.engines[w].prompts().last(),
                Some(&prompt),
                "a prompt worker {} holds went elsewhere",
                w + 1
            );
        }
    }
    let r = a.status().await.routing;
    assert_eq!(r.placements, 8);
    assert_eq!(
        r.cache_candidate, 8,
        "no placement without a cache candidate"
    );
    assert_eq!(r.matched_blocks, r.prompt_blocks);
    no_frame_refused(&t.net);
    drop(b);
}
