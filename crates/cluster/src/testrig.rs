//! What the Router tests (`tests`, `pd_tests`) share: a Router on node 0 of
//! an in-process network, waiting for nodes to come up, reading a stream
//! to its end.

use std::sync::Arc;
use std::time::Duration;

use flotilla_config::ClusterSection;
use flotilla_engine::RequestStream;
use flotilla_proto::{EngineEvent, Role};

use crate::memnet::MemNet;
use crate::{
    ClusterEngine, NodeSettings, RouterHooks, RouterOptions, node_settings, router_options,
};

/// A cluster config's settings with the tests' fast heartbeat and down
/// bound (a whole number of heartbeats).
pub(crate) fn cluster(heartbeat: Duration, down_after: Duration) -> ClusterSection {
    let hb = heartbeat.as_millis() as u64;
    ClusterSection {
        heartbeat_interval_ms: hb,
        down_after_missed: (down_after.as_millis() as u64 / hb) as u32,
        ..ClusterSection::defaults()
    }
}

/// An engine node's settings for the tests: their timing, orphans looked
/// for once a second (as long as the tests' transfers can take).
pub(crate) fn node_opts(heartbeat: Duration, down_after: Duration, role: Role) -> NodeSettings {
    let cl = cluster(heartbeat, down_after);
    assert_eq!(
        cl.down_after(),
        down_after,
        "the down bound is whole heartbeats"
    );
    NodeSettings {
        reconcile_interval: Duration::from_secs(1),
        ..node_settings(&cl, vec![0], role)
    }
}

/// The Router's settings for engine nodes 1.. of `roles`, named
/// `{role}-{node}`.
pub(crate) fn router_opts(
    roles: &[Role],
    block_size: usize,
    heartbeat: Duration,
    down_after: Duration,
) -> RouterOptions {
    RouterOptions {
        prefix_blocks_max: 1000,
        ..router_options(
            &cluster(heartbeat, down_after),
            roles
                .iter()
                .enumerate()
                .map(|(i, r)| (i as u32 + 1, format!("{r}-{}", i + 1), *r))
                .collect(),
            block_size,
            vec![0],
        )
    }
}

/// A Router at node 0 of `net` that knows one engine node per entry of
/// `roles` (nodes 1..), named `{role}-{node}`.
pub(crate) async fn start_router(
    net: &Arc<MemNet>,
    roles: &[Role],
    block_size: usize,
    heartbeat: Duration,
    down_after: Duration,
) -> ClusterEngine {
    let opts = router_opts(roles, block_size, heartbeat, down_after);
    start_router_with(net, opts, RouterHooks::default()).await
}

/// A Router at node 0 of `net` with `opts` and the shell's `hooks`.
pub(crate) async fn start_router_with(
    net: &Arc<MemNet>,
    opts: RouterOptions,
    hooks: RouterHooks,
) -> ClusterEngine {
    let (t, rx) = net.join(0, 1);
    ClusterEngine::start_with(t, rx, opts, hooks)
        .await
        .expect("router starts")
}

/// Waits until exactly `n` nodes are up (two seconds at most).
pub(crate) async fn wait_up(router: &ClusterEngine, n: usize) {
    for _ in 0..400 {
        if router.up_nodes().await.len() == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("only {:?} came up", router.up_nodes().await);
}

/// Reads a stream to its end: (tokens, terminal event).
pub(crate) async fn drain(mut s: RequestStream) -> (Vec<u32>, EngineEvent) {
    let mut toks = Vec::new();
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(5), s.recv())
            .await
            .expect("stream stalled")
            .expect("stream ended without a terminal event");
        match ev {
            EngineEvent::Token(t) => toks.push(t.token),
            e => return (toks, e),
        }
    }
}
