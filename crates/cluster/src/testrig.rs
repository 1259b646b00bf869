//! What the Router tests (`tests`, `pd_tests`) share: the simulated network
//! (`flotilla_transport::sim`: every message through the frame codec, cap
//! and role checks, with a modelled latency), a Router on its node 0,
//! waiting for nodes to come up, reading a stream to its end.
//!
//! Every test runs on a paused tokio clock (`start_paused = true`): when
//! every task waits, the runtime jumps to the next due timer, so a test
//! that models seconds of heartbeats and transfers takes milliseconds of
//! wall time and runs the same way each time.

use std::sync::Arc;
use std::time::Duration;

use flotilla_config::{ClusterConfig, ClusterSection};
use flotilla_engine::RequestStream;
use flotilla_proto::{EngineEvent, Role};

use flotilla_exec::rng::Rng;
use flotilla_transport::Transport;
use flotilla_transport::sim::{LinkConfig, SimNet};

use crate::{
    ClusterEngine, Connect, NodeSettings, RouterHooks, RouterOptions, node_settings, router_options,
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
        ..node_settings(&ClusterConfig::open(), &cl, vec![0], role, "")
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
            &ClusterConfig::open(),
            &cluster(heartbeat, down_after),
            roles
                .iter()
                .enumerate()
                .map(|(i, r)| (i as u32 + 1, format!("{r}-{}", i + 1), *r))
                .collect(),
            block_size,
        )
    }
}

/// A Router at node 0 of `net` that knows one engine node per entry of
/// `roles` (nodes 1..), named `{role}-{node}`.
pub(crate) async fn start_router(
    net: &Arc<SimNet>,
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
    net: &Arc<SimNet>,
    opts: RouterOptions,
    hooks: RouterHooks,
) -> ClusterEngine {
    ClusterEngine::start_with(connect(net, 0, 1), opts, hooks)
        .await
        .expect("router starts")
}

/// Waits until exactly `n` nodes are up (two seconds at most).
pub(crate) async fn wait_up(router: &ClusterEngine, n: usize) {
    for _ in 0..400 {
        if router.up_nodes().await.len() == n {
            return;
        }
        pass(Duration::from_millis(5)).await;
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

/// The network of a test: node 0 the Router, nodes 1.. of `roles`. Links
/// of the simulator's default latency; a dead peer's connection idles out
/// in 300 ms (a transfer to it hangs that long, as over QUIC).
pub(crate) fn net(roles: &[Role]) -> Arc<SimNet> {
    let all = std::iter::once(Role::Router)
        .chain(roles.iter().copied())
        .collect();
    let link = LinkConfig {
        idle_timeout_ms: 300,
        ..LinkConfig::default()
    };
    SimNet::new(all, link, Rng::new(1))
}

/// Joins `node` to `net` at `epoch` when its actor starts.
pub(crate) fn connect(net: &Arc<SimNet>, node: u32, epoch: u64) -> Connect {
    let net = net.clone();
    Box::new(move |sink| Ok(net.join(node, epoch, sink) as Arc<dyn Transport>))
}

/// Lets `d` of (virtual) time pass for the calling task: a timeout on a
/// future that never ends, the clock's plain wait. On the paused clock it
/// costs no wall time.
pub(crate) async fn pass(d: Duration) {
    let never = std::future::pending::<()>();
    let _ = tokio::time::timeout(d, never).await;
}

/// Waits (virtual time, 2 s at most) until `f` holds.
pub(crate) async fn until(what: &str, f: impl Fn() -> bool) {
    for _ in 0..400 {
        if f() {
            return;
        }
        pass(Duration::from_millis(5)).await;
    }
    panic!("timed out waiting for {what}");
}

/// Fails if the network refused a frame (a message over the cap, a kind
/// its sender's role may not send, a payload that does not round-trip).
pub(crate) fn no_frame_refused(net: &SimNet) {
    assert_eq!(net.refused_frame(), None, "the codec refused a frame");
}
