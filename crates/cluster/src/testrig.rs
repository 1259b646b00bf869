//! What the Router tests (`tests`, `pd_tests`) share: a Router on node 0 of
//! an in-process network, waiting for nodes to come up, reading a stream
//! to its end.

use std::sync::Arc;
use std::time::Duration;

use flotilla_proto::{EngineEvent, RequestStream, Role};

use crate::memnet::MemNet;
use crate::{ClusterEngine, RouterOptions};

/// A Router at node 0 of `net` that knows one engine node per entry of
/// `roles` (nodes 1..), named `{role}-{node}`.
pub(crate) fn start_router(
    net: &Arc<MemNet>,
    roles: &[Role],
    block_size: usize,
    heartbeat: Duration,
    down_after: Duration,
) -> ClusterEngine {
    let (t, rx) = net.join(0, 1);
    ClusterEngine::start(
        t,
        rx,
        RouterOptions {
            workers: roles
                .iter()
                .enumerate()
                .map(|(i, r)| (i as u32 + 1, format!("{r}-{}", i + 1), *r))
                .collect(),
            heartbeat_interval: heartbeat,
            down_after,
            block_size,
            tenant_salts: vec![0],
            reruns_max: 2,
            prefix_blocks_max: 1000,
        },
    )
}

/// Waits until exactly `n` nodes are up (two seconds at most).
pub(crate) async fn wait_up(router: &ClusterEngine, n: usize) {
    for _ in 0..400 {
        if router.up_nodes().len() == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("only {:?} came up", router.up_nodes());
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
