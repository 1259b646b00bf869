//! What the cores' tests share: settings as a cluster config with the
//! tests' fast heartbeat would give them.

use std::time::Duration;

use flotilla_config::ClusterSection;
use flotilla_proto::Role;

use crate::node::NodeSettings;

/// An engine node's settings, from the default cluster config with the
/// tests' heartbeat and down bound (a whole number of heartbeats), and
/// orphans looked for once a second. The cluster crate builds them the
/// same way (`flotilla_cluster::node_settings`), which its tests check.
pub(crate) fn node_opts(heartbeat: Duration, down_after: Duration, role: Role) -> NodeSettings {
    let cl = ClusterSection::defaults();
    assert_eq!(
        down_after.as_millis() % heartbeat.as_millis(),
        0,
        "the down bound is whole heartbeats"
    );
    NodeSettings {
        routers: vec![0],
        heartbeat_interval: heartbeat,
        down_after,
        num_tenants: 1,
        frame_len_max_bytes: cl.frame_len_max_bytes,
        role,
        model: String::new(),
        reservation_ttl: Duration::from_millis(cl.kv_reservation_ttl_ms),
        hold_ttl: Duration::from_millis(cl.kv_hold_ttl_ms),
        tenant_priority: Vec::new(),
        transfers_max: cl.kv_transfers_max,
        reconcile_interval: Duration::from_secs(1),
    }
}
