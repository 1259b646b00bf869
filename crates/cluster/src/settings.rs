//! The cores' settings from the config: the one place they are built.
//! `flotilla node` (and the nodes `flotilla cluster` starts) and `flotilla
//! simulate` build a node's from the same [`ClusterConfig`] they build its
//! engine's from (`EngineSection::resolve`, `ClusterConfig::sched_config`,
//! as `flotilla serve` does).

use std::time::Duration;

use flotilla_config::{ClusterConfig, ClusterSection};
use flotilla_cores::node::NodeSettings;
use flotilla_cores::router::{MOVES_MAX, PREFIX_BLOCKS_MAX, RERUNS_MAX, RouterOptions};
use flotilla_proto::{NodeId, Role};

/// The Router's settings: its engine nodes (id, name, role), the
/// cluster's timing, the engines' `block_size` and the tenants' prefix
/// salts (as the engines salt their caches).
pub fn router_options(
    cfg: &ClusterConfig,
    cl: &ClusterSection,
    workers: Vec<(NodeId, String, Role)>,
    block_size: usize,
) -> RouterOptions {
    RouterOptions {
        workers,
        heartbeat_interval: Duration::from_millis(cl.heartbeat_interval_ms),
        down_after: cl.down_after(),
        block_size,
        tenant_salts: cfg.tenants.iter().map(|t| t.prefix_salt()).collect(),
        reruns_max: RERUNS_MAX,
        moves_max: MOVES_MAX,
        prefix_blocks_max: PREFIX_BLOCKS_MAX,
        forget_after: Duration::from_millis(cl.forget_after_ms),
    }
}

/// An engine node's settings: its Routers and role, the served `model`
/// (KV of another is refused), the config's tenants and their tiers'
/// priorities (the order of waiting KV transfers), the cluster's timing
/// and transfer limits.
pub fn node_settings(
    cfg: &ClusterConfig,
    cl: &ClusterSection,
    routers: Vec<NodeId>,
    role: Role,
    model: &str,
) -> NodeSettings {
    NodeSettings {
        routers,
        heartbeat_interval: Duration::from_millis(cl.heartbeat_interval_ms),
        down_after: cl.down_after(),
        num_tenants: cfg.tenants.len().max(1) as u32,
        frame_len_max_bytes: cl.frame_len_max_bytes,
        role,
        model: model.to_string(),
        reservation_ttl: Duration::from_millis(cl.kv_reservation_ttl_ms),
        hold_ttl: Duration::from_millis(cl.kv_hold_ttl_ms),
        tenant_priority: cfg
            .tenants
            .iter()
            .map(|t| cfg.tiers.get(t.tier).map_or(0, |tier| tier.priority))
            .collect(),
        transfers_max: cl.kv_transfers_max,
        // Orphans are looked for once per down bound.
        reconcile_interval: cl.down_after(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_s_tenants_and_priorities_are_the_config_s() {
        let text = "[[tiers]]\nname = \"paid\"\npriority = 3\n[[tiers]]\nname = \"free\"\n\
                    [[tenants]]\nname = \"f\"\ntier = \"free\"\napi_keys = [\"key-free-1\"]\n\
                    [[tenants]]\nname = \"p\"\ntier = \"paid\"\napi_keys = [\"key-paid-1\"]\n";
        let cfg = ClusterConfig::parse(text, "test").unwrap();
        let cl = ClusterSection::defaults();
        let s = node_settings(&cfg, &cl, vec![0], Role::Decode, "m");
        assert_eq!((s.num_tenants, s.tenant_priority.clone()), (2, vec![0, 3]));
        assert_eq!((s.model.as_str(), s.role), ("m", Role::Decode));
        assert_eq!(s.down_after, cl.down_after());
        let r = router_options(&cfg, &cl, vec![], 16);
        assert_eq!(r.tenant_salts.len(), 2);
        // An open config: one default tenant.
        let open = node_settings(&ClusterConfig::open(), &cl, vec![0], Role::Worker, "m");
        assert_eq!(open.num_tenants, 1);
    }
}
