//! The cores' settings from the cluster config: the one place they are
//! built (`flotilla node`, `flotilla cluster`, the simulator and the tests
//! start from here).

use std::time::Duration;

use flotilla_config::ClusterSection;
use flotilla_cores::node::NodeSettings;
use flotilla_cores::router::{MOVES_MAX, PREFIX_BLOCKS_MAX, RERUNS_MAX, RouterOptions};
use flotilla_proto::{NodeId, Role};

/// The Router's settings: its engine nodes (id, name, role) from the
/// config, `block_size` and the tenants' prefix salts as the engines use
/// them.
pub fn router_options(
    cl: &ClusterSection,
    workers: Vec<(NodeId, String, Role)>,
    block_size: usize,
    tenant_salts: Vec<u64>,
) -> RouterOptions {
    RouterOptions {
        workers,
        heartbeat_interval: Duration::from_millis(cl.heartbeat_interval_ms),
        down_after: cl.down_after(),
        block_size,
        tenant_salts,
        reruns_max: RERUNS_MAX,
        moves_max: MOVES_MAX,
        prefix_blocks_max: PREFIX_BLOCKS_MAX,
    }
}

/// An engine node's settings: its Routers and role, the cluster's timing
/// and transfer limits; the served model, the tenant count and their
/// tiers' priorities come from the engine's own settings (empty here:
/// the caller sets them).
pub fn node_settings(cl: &ClusterSection, routers: Vec<NodeId>, role: Role) -> NodeSettings {
    NodeSettings {
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
    }
}
