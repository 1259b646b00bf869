//! The `[cluster]` section and its `[[nodes]]`: who is in the cluster, where
//! each node is reached and binds, and the caps of the control channel.
//!
//! ```toml
//! [cluster]
//! certs_dir = "../.flotilla/certs/two-workers"
//! heartbeat_interval_ms = 500
//!
//! [[nodes]]
//! name = "router"
//! role = "router"
//! addr = "127.0.0.1:7400"
//! http = "127.0.0.1:8000"
//!
//! [[nodes]]
//! name = "worker-1"
//! role = "worker"
//! addr = "127.0.0.1:7401"
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::ConfigError;
pub use flotilla_proto::Role;

/// Most nodes one cluster may declare: node ids are `u32`, but every table
/// the router keeps per node is sized from this count.
pub const NODES_MAX: usize = 1024;

/// Where certificates live when `[cluster]` does not say: `certs` beside the
/// config file.
const CERTS_DIR_DEFAULT: &str = "certs";

/// The `[cluster]` section and its nodes, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct ClusterSection {
    /// Holds `ca.pem`, `ca.key`, `NODE.pem`, `NODE.key`. As written by
    /// [`crate::ClusterConfig::parse`]; [`crate::ClusterConfig::load`]
    /// resolves a relative path against the config file's directory.
    pub certs_dir: PathBuf,
    /// How often each node sends a heartbeat, ms (10..=60000).
    pub heartbeat_interval_ms: u64,
    /// A node silent for this many heartbeat intervals is down (1..=100).
    pub down_after_missed: u32,
    /// Cap on one control frame, bytes (4096..=268435456).
    pub frame_len_max_bytes: u32,
    /// Messages that may wait to be sent to one peer (1..=1048576).
    pub send_queue_len_max: usize,
    /// Longest wait between reconnect attempts, ms (10..=60000).
    pub reconnect_backoff_max_ms: u64,
    /// A QUIC connection with no traffic for this long is closed, ms
    /// (at least 2 heartbeat intervals, at most 600000).
    pub idle_timeout_ms: u64,
    /// Decode node: how long blocks reserved for a prompt's KV wait for
    /// the prefill node, ms (100..=600000).
    pub kv_reservation_ttl_ms: u64,
    /// Prefill node: how long a finished prefill's blocks wait for the
    /// decode node's ack, ms (100..=600000).
    pub kv_hold_ttl_ms: u64,
    /// Prefill node: KV transfers sent at once (1..=64).
    pub kv_transfers_max: usize,
    /// Keys for the router's admin endpoints (`POST /admin/drain`), sent
    /// as `Authorization: Bearer KEY`; none: those endpoints are off.
    pub admin_keys: Vec<String>,
    /// How a pipeline group's stages pass the residual stream's rows:
    /// `f16` (2 bytes a value; the default) or `f32` (4, exactly one
    /// node's numbers).
    pub pipeline_activations: String,
    /// Whether nodes that are not in `[[nodes]]` may join at run time
    /// (`flotilla node --join`), on a certificate the cluster CA signed
    /// for an engine role (default true).
    pub allow_join: bool,
    /// A file of revoked node names and certificate serial numbers (one
    /// per line, `#` comments), read again whenever it changes; a node it
    /// names is refused, and cut off if connected. As written by
    /// [`crate::ClusterConfig::parse`]; `load` resolves a relative path
    /// against the config file's directory.
    pub revocation_list: Option<PathBuf>,
    /// A node that joined at run time and has been down this long is
    /// forgotten by the Routers, ms (1000..=86400000).
    pub forget_after_ms: u64,
    /// Nodes in file order; a node's index is its node id.
    pub nodes: Vec<Node>,
}

/// One `[[nodes]]` table, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// Unique name, `[A-Za-z0-9-]{1,63}`; also the name in its certificate.
    pub name: String,
    /// What the node does.
    pub role: Role,
    /// How peers reach its QUIC endpoint: `host:port`, host an IP or a DNS name.
    pub addr: String,
    /// The UDP socket its QUIC endpoint binds.
    pub listen: SocketAddr,
    /// UDP port of its bulk (KV transfer) endpoint, on `listen`'s address;
    /// 0 = any free port. Peers learn it when they connect; set it where a
    /// firewall must name the port.
    pub bulk_port: u16,
    /// Where the OpenAI API listens (TCP); set on the router and only there.
    pub http: Option<SocketAddr>,
    /// An engine node's observability address (TCP): `/metrics`, `/health`,
    /// `/ready` and `/config`, no API. None: the node serves no HTTP.
    pub metrics: Option<SocketAddr>,
    /// The pipeline group this node is a stage of: the group's nodes, in
    /// file order, are its stages 0, 1, ...; stage 0 runs the engine (the
    /// Router sees the group as that one node), later stages run layers
    /// for it and nothing else. None: the node holds the whole model.
    pub pipeline: Option<String>,
    /// The model's layers this stage runs (`"0..12"`), given on every node
    /// of a group or on none (then stage 0 splits the layers by cost).
    pub layers: Option<std::ops::Range<usize>>,
}

impl ClusterSection {
    /// The id (index) of the node with this name.
    pub fn node_id(&self, name: &str) -> Option<u32> {
        self.nodes
            .iter()
            .position(|n| n.name == name)
            .map(|i| i as u32)
    }

    /// The node with this name.
    pub fn node(&self, name: &str) -> Option<&Node> {
        self.nodes.iter().find(|n| n.name == name)
    }

    /// The first router and its id. Validation guarantees at least one;
    /// panics on a hand-built section without one.
    pub fn router(&self) -> (u32, &Node) {
        self.routers()
            .next()
            .expect("a validated cluster has a router")
    }

    /// Every router, with its id, in file order. Each serves the API and
    /// places on every engine; the engines admit from all of them.
    pub fn routers(&self) -> impl Iterator<Item = (u32, &Node)> {
        self.ids().filter(|(_, n)| n.role == Role::Router)
    }

    /// This router's place among the routers (0-based) and how many there
    /// are: a tenant's limits are split between them by it.
    pub fn router_share(&self, name: &str) -> Option<(usize, usize)> {
        let all: Vec<&str> = self.routers().map(|(_, n)| n.name.as_str()).collect();
        all.iter().position(|n| *n == name).map(|i| (i, all.len()))
    }

    /// The nodes that run an engine (all but the router and the later
    /// stages of pipeline groups: a group runs its engine on stage 0),
    /// with their ids.
    pub fn engines(&self) -> impl Iterator<Item = (u32, &Node)> {
        self.ids()
            .filter(|(_, n)| n.role.runs_engine() && self.stage_of(n).is_none_or(|s| s == 0))
    }

    /// A pipeline group's nodes in stage order (file order), with ids;
    /// empty for a name no node gives.
    pub fn group(&self, name: &str) -> Vec<(u32, &Node)> {
        self.ids()
            .filter(|(_, n)| n.pipeline.as_deref() == Some(name))
            .collect()
    }

    /// A node's stage in its pipeline group; None for a node that holds
    /// the whole model.
    pub fn stage_of(&self, node: &Node) -> Option<usize> {
        let g = node.pipeline.as_deref()?;
        self.group(g).iter().position(|(_, n)| n.name == node.name)
    }

    /// How long a silent node stays up: `down_after_missed` heartbeat intervals.
    pub fn down_after(&self) -> Duration {
        Duration::from_millis(
            self.heartbeat_interval_ms
                .saturating_mul(u64::from(self.down_after_missed)),
        )
    }

    fn ids(&self) -> impl Iterator<Item = (u32, &Node)> {
        self.nodes.iter().enumerate().map(|(i, n)| (i as u32, n))
    }
}

/// `[cluster]` as written. Numbers are read as `i64` so that an out-of-range
/// value is refused with the field's range rather than a serde type error.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawCluster {
    certs_dir: Option<String>,
    heartbeat_interval_ms: Option<i64>,
    down_after_missed: Option<i64>,
    frame_len_max_bytes: Option<i64>,
    send_queue_len_max: Option<i64>,
    reconnect_backoff_max_ms: Option<i64>,
    idle_timeout_ms: Option<i64>,
    kv_reservation_ttl_ms: Option<i64>,
    kv_hold_ttl_ms: Option<i64>,
    kv_transfers_max: Option<i64>,
    #[serde(default)]
    admin_keys: Vec<String>,
    pipeline_activations: Option<String>,
    allow_join: Option<bool>,
    revocation_list: Option<String>,
    forget_after_ms: Option<i64>,
}

/// One `[[nodes]]` table as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawNode {
    name: String,
    role: String,
    addr: String,
    listen: Option<String>,
    bulk_port: Option<i64>,
    http: Option<String>,
    metrics: Option<String>,
    pipeline: Option<String>,
    layers: Option<String>,
}

/// Builds an error at a byte offset of the file.
pub(crate) type Invalid<'a> = &'a dyn Fn(usize, String) -> ConfigError;

/// Validates `[cluster]` and `[[nodes]]`; `None` when the file has neither.
pub(crate) fn validate(
    cluster: Option<&toml::Spanned<RawCluster>>,
    nodes: &[toml::Spanned<RawNode>],
    invalid: Invalid<'_>,
) -> Result<Option<ClusterSection>, ConfigError> {
    let Some(first) = nodes.first() else {
        return match cluster {
            None => Ok(None),
            Some(c) => Err(invalid(
                c.span().start,
                "[cluster] has no nodes: add [[nodes]] tables (one router and at least one worker)"
                    .into(),
            )),
        };
    };
    // Errors about the cluster as a whole point at [cluster], or at the
    // first node when the file relies on the defaults.
    let whole_at = cluster.map_or(first.span().start, |c| c.span().start);
    let section = settings(cluster, invalid)?;
    if nodes.len() > NODES_MAX {
        return Err(invalid(
            whole_at,
            format!("{} nodes: at most {NODES_MAX}", nodes.len()),
        ));
    }
    let mut out: Vec<Node> = Vec::with_capacity(nodes.len());
    // The host part of each addr, lowercased: nodes with the same host share
    // its sockets.
    let mut hosts: Vec<String> = Vec::with_capacity(nodes.len());
    for raw in nodes {
        let at = raw.span().start;
        let node = node(raw.get_ref(), &|m| invalid(at, m))?;
        let host = addr_host(&node.addr);
        let name = &node.name;
        for (other, other_host) in out.iter().zip(&hosts) {
            if other.name == *name {
                return Err(invalid(at, format!("node '{name}' is defined twice")));
            }
            // A name is also a certificate's DNS name, which peers match
            // without case: 'W-1' could present 'w-1''s certificate.
            if other.name.eq_ignore_ascii_case(name) {
                return Err(invalid(
                    at,
                    format!(
                        "node '{name}' is defined twice: node '{}' differs only in case, and certificate names ignore case",
                        other.name
                    ),
                ));
            }
            if other.addr.eq_ignore_ascii_case(&node.addr) {
                return Err(invalid(
                    at,
                    format!(
                        "node '{name}': addr '{}' is also node '{}''s",
                        node.addr, other.name
                    ),
                ));
            }
            // 0.0.0.0:7400 on two pods is fine; on one host it is not. A
            // specific IP names one host, so a repeat always collides.
            if other.listen == node.listen
                && (!node.listen.ip().is_unspecified() || *other_host == host)
            {
                return Err(invalid(
                    at,
                    format!(
                        "node '{name}': listen {} is also node '{}''s",
                        node.listen, other.name
                    ),
                ));
            }
            // Two routers' API sockets collide the same way.
            if let (Some(a), Some(b)) = (node.http, other.http)
                && a == b
                && (!a.ip().is_unspecified() || *other_host == host)
            {
                return Err(invalid(
                    at,
                    format!("node '{name}': http {a} is also node '{}''s", other.name),
                ));
            }
        }
        out.push(node);
        hosts.push(host);
    }
    if !out.iter().any(|n| n.role == Role::Router) {
        return Err(invalid(
            whole_at,
            "the cluster has no router: at least one [[nodes]] needs role = \"router\"".into(),
        ));
    }
    // Engine nodes may all join at run time; with joining off, one must be
    // declared.
    if !section.allow_join && !out.iter().any(|n| n.role.runs_engine()) {
        return Err(invalid(
            whole_at,
            "the cluster has no engine node and allow_join = false: add a [[nodes]] with role \
             worker, prefill or decode, or let workers join"
                .into(),
        ));
    }
    // A prefill node only serves decode nodes; a decode node alone runs
    // whole requests, so it needs no prefill node.
    if out.iter().any(|n| n.role == Role::Prefill) && !out.iter().any(|n| n.role == Role::Decode) {
        return Err(invalid(
            whole_at,
            "the cluster has prefill nodes but no decode node to send their KV to: add a \
             [[nodes]] with role = \"decode\""
                .into(),
        ));
    }
    check_groups(&out).map_err(|why| invalid(whole_at, why))?;
    Ok(Some(ClusterSection {
        nodes: out,
        ..section
    }))
}

/// Every numeric `[cluster]` setting: name, default, smallest, largest.
/// The one place their defaults and ranges are written: a config file's
/// values and a section built in code ([`ClusterSection::check`], the
/// simulator's) are checked against it.
const NUMBERS: [(&str, i64, i64, i64); 10] = [
    ("heartbeat_interval_ms", 500, 10, 60_000),
    ("down_after_missed", 3, 1, 100),
    ("frame_len_max_bytes", 1 << 20, 4096, 1 << 28),
    ("send_queue_len_max", 4096, 1, 1 << 20),
    ("reconnect_backoff_max_ms", 2000, 10, 60_000),
    ("idle_timeout_ms", 10_000, 10, 600_000),
    ("kv_reservation_ttl_ms", 30_000, 100, 600_000),
    ("kv_hold_ttl_ms", 30_000, 100, 600_000),
    ("kv_transfers_max", 2, 1, 64),
    ("forget_after_ms", 60_000, 1000, 86_400_000),
];

/// `v` (or the default) for setting `field`, or why it is out of range.
fn number(field: &str, v: Option<i64>) -> Result<i64, String> {
    let &(_, default, lo, hi) = NUMBERS
        .iter()
        .find(|n| n.0 == field)
        .expect("a known setting");
    let v = v.unwrap_or(default);
    if (lo..=hi).contains(&v) {
        Ok(v)
    } else {
        Err(format!("cluster.{field} = {v} is out of range {lo}..={hi}"))
    }
}

impl ClusterSection {
    /// The section a config file with an empty `[cluster]` gets: every
    /// default, no nodes.
    pub fn defaults() -> ClusterSection {
        let none = |_: usize, message: String| ConfigError::Invalid {
            origin: "<defaults>".into(),
            line: 0,
            message,
        };
        settings(None, &none).expect("the defaults are in range")
    }

    /// Checks a section built in code as a config file's is checked;
    /// the error names the setting, its value and its range.
    pub fn check(&self) -> Result<(), String> {
        let values: [(&str, i64); 10] = [
            ("heartbeat_interval_ms", self.heartbeat_interval_ms as i64),
            ("down_after_missed", i64::from(self.down_after_missed)),
            ("frame_len_max_bytes", i64::from(self.frame_len_max_bytes)),
            ("send_queue_len_max", self.send_queue_len_max as i64),
            (
                "reconnect_backoff_max_ms",
                self.reconnect_backoff_max_ms as i64,
            ),
            ("idle_timeout_ms", self.idle_timeout_ms as i64),
            ("kv_reservation_ttl_ms", self.kv_reservation_ttl_ms as i64),
            ("kv_hold_ttl_ms", self.kv_hold_ttl_ms as i64),
            ("kv_transfers_max", self.kv_transfers_max as i64),
            ("forget_after_ms", self.forget_after_ms as i64),
        ];
        for (field, v) in values {
            number(field, Some(v))?;
        }
        idle_covers_heartbeats(self.idle_timeout_ms, self.heartbeat_interval_ms)
    }
}

/// A connection must outlive at least one lost heartbeat, or a single
/// dropped datagram closes it.
fn idle_covers_heartbeats(idle_timeout_ms: u64, heartbeat_interval_ms: u64) -> Result<(), String> {
    if idle_timeout_ms < 2 * heartbeat_interval_ms {
        return Err(format!(
            "cluster.idle_timeout_ms = {idle_timeout_ms} must be at least 2 * heartbeat_interval_ms ({})",
            2 * heartbeat_interval_ms
        ));
    }
    Ok(())
}

/// The `[cluster]` settings with defaults filled in and ranges checked;
/// `nodes` is left empty.
pub(crate) fn settings(
    cluster: Option<&toml::Spanned<RawCluster>>,
    invalid: Invalid<'_>,
) -> Result<ClusterSection, ConfigError> {
    let at = cluster.map_or(0, |c| c.span().start);
    let empty = RawCluster {
        certs_dir: None,
        heartbeat_interval_ms: None,
        down_after_missed: None,
        frame_len_max_bytes: None,
        send_queue_len_max: None,
        reconnect_backoff_max_ms: None,
        idle_timeout_ms: None,
        kv_reservation_ttl_ms: None,
        kv_hold_ttl_ms: None,
        kv_transfers_max: None,
        admin_keys: Vec::new(),
        pipeline_activations: None,
        allow_join: None,
        revocation_list: None,
        forget_after_ms: None,
    };
    let c = cluster.map_or(&empty, |c| c.get_ref());
    let range = |field: &str, v: Option<i64>| number(field, v).map_err(|why| invalid(at, why));
    let certs_dir = c.certs_dir.as_deref().unwrap_or(CERTS_DIR_DEFAULT);
    if certs_dir.is_empty() {
        return Err(invalid(at, "cluster.certs_dir is empty".into()));
    }
    let heartbeat_interval_ms = range("heartbeat_interval_ms", c.heartbeat_interval_ms)?;
    let down_after_missed = range("down_after_missed", c.down_after_missed)?;
    let frame_len_max_bytes = range("frame_len_max_bytes", c.frame_len_max_bytes)?;
    let send_queue_len_max = range("send_queue_len_max", c.send_queue_len_max)?;
    let reconnect_backoff_max_ms = range("reconnect_backoff_max_ms", c.reconnect_backoff_max_ms)?;
    let idle_timeout_ms = range("idle_timeout_ms", c.idle_timeout_ms)?;
    idle_covers_heartbeats(idle_timeout_ms as u64, heartbeat_interval_ms as u64)
        .map_err(|why| invalid(at, why))?;
    let kv_reservation_ttl_ms = range("kv_reservation_ttl_ms", c.kv_reservation_ttl_ms)?;
    let kv_hold_ttl_ms = range("kv_hold_ttl_ms", c.kv_hold_ttl_ms)?;
    let kv_transfers_max = range("kv_transfers_max", c.kv_transfers_max)?;
    let forget_after_ms = range("forget_after_ms", c.forget_after_ms)?;
    if c.revocation_list.as_deref() == Some("") {
        return Err(invalid(at, "cluster.revocation_list is empty".into()));
    }
    if c.admin_keys.iter().any(|k| !crate::operator_key_ok(k)) {
        return Err(invalid(
            at,
            "[cluster] admin_keys need at least 16 characters and no whitespace".into(),
        ));
    }
    let pipeline_activations = c.pipeline_activations.as_deref().unwrap_or("f16");
    if !matches!(pipeline_activations, "f16" | "f32") {
        return Err(invalid(
            at,
            format!("cluster.pipeline_activations '{pipeline_activations}' is f16 or f32"),
        ));
    }
    // The ranges above fit every target type: the casts cannot truncate.
    Ok(ClusterSection {
        pipeline_activations: pipeline_activations.to_string(),
        certs_dir: PathBuf::from(certs_dir),
        heartbeat_interval_ms: heartbeat_interval_ms as u64,
        down_after_missed: down_after_missed as u32,
        frame_len_max_bytes: frame_len_max_bytes as u32,
        send_queue_len_max: send_queue_len_max as usize,
        reconnect_backoff_max_ms: reconnect_backoff_max_ms as u64,
        idle_timeout_ms: idle_timeout_ms as u64,
        kv_reservation_ttl_ms: kv_reservation_ttl_ms as u64,
        kv_hold_ttl_ms: kv_hold_ttl_ms as u64,
        kv_transfers_max: kv_transfers_max as usize,
        admin_keys: c.admin_keys.clone(),
        allow_join: c.allow_join.unwrap_or(true),
        revocation_list: c.revocation_list.as_ref().map(PathBuf::from),
        forget_after_ms: forget_after_ms as u64,
        nodes: Vec::new(),
    })
}

/// Validates one node on its own (name, role, addresses); `fail` builds an
/// error at its table.
fn node(raw: &RawNode, fail: &dyn Fn(String) -> ConfigError) -> Result<Node, ConfigError> {
    let name = &raw.name;
    if !node_name_ok(name) {
        return Err(fail(format!(
            "node name '{name}' must be 1 to 63 characters of A-Z, a-z, 0-9 and '-', \
             not start or end with '-', not be all digits and not be 'ca'"
        )));
    }
    let role: Role = raw
        .role
        .parse()
        .map_err(|why: String| fail(format!("node '{name}': role: {why}")))?;
    check_addr(&raw.addr)
        .map_err(|why| fail(format!("node '{name}': addr '{}' {why}", raw.addr)))?;
    let listen = match &raw.listen {
        Some(l) => {
            let listen: SocketAddr = l.parse().map_err(|_| {
                fail(format!(
                    "node '{name}': listen '{l}' is not a socket address (ip:port, e.g. 0.0.0.0:7400)"
                ))
            })?;
            if listen.port() == 0 {
                return Err(fail(format!(
                    "node '{name}': listen '{l}' needs a port in 1..=65535 (peers dial a fixed port)"
                )));
            }
            listen
        }
        None => raw.addr.parse().map_err(|_| {
            fail(format!(
                "node '{name}': addr '{}' is a host name, set listen (e.g. listen = \"0.0.0.0:7400\")",
                raw.addr
            ))
        })?,
    };
    let bulk_port = match raw.bulk_port {
        None => 0,
        Some(p) => match u16::try_from(p) {
            Ok(p) if p != 0 && p != listen.port() => p,
            _ => {
                return Err(fail(format!(
                    "node '{name}': bulk_port {p} must be in 1..=65535 and differ from listen's port {}                      (leave it out for any free port)",
                    listen.port()
                )));
            }
        },
    };
    let http = match (&raw.http, role) {
        (None, Role::Router) => {
            return Err(fail(format!(
                "node '{name}': a router needs http (the socket address of the OpenAI API, e.g. \"127.0.0.1:8000\")"
            )));
        }
        (None, _) => None,
        (Some(_), r) if r != Role::Router => {
            return Err(fail(format!(
                "node '{name}': http is only for the router (this node's role is {r})"
            )));
        }
        (Some(h), _) => Some(h.parse::<SocketAddr>().map_err(|_| {
            fail(format!(
                "node '{name}': http '{h}' is not a socket address (ip:port, e.g. 127.0.0.1:8000)"
            ))
        })?),
    };
    let metrics = match (&raw.metrics, role) {
        (None, _) => None,
        (Some(_), Role::Router) => {
            return Err(fail(format!(
                "node '{name}': metrics is for engine nodes (the router serves /metrics on its http address)"
            )));
        }
        (Some(m), _) => {
            let a = m.parse::<SocketAddr>().map_err(|_| {
                fail(format!(
                    "node '{name}': metrics '{m}' is not a socket address (ip:port, e.g. 0.0.0.0:9400)"
                ))
            })?;
            if a.port() == 0 {
                return Err(fail(format!(
                    "node '{name}': metrics '{m}' needs a port in 1..=65535 (a scraper dials a fixed port)"
                )));
            }
            Some(a)
        }
    };
    if raw.pipeline.is_some() && role == Role::Router {
        return Err(fail(format!(
            "node '{name}': the router is no pipeline stage (pipeline is for engine nodes)"
        )));
    }
    if let Some(g) = &raw.pipeline
        && !node_name_ok(g)
    {
        return Err(fail(format!(
            "node '{name}': pipeline '{g}' must be 1 to 63 characters of A-Z, a-z, 0-9 and '-'"
        )));
    }
    let layers = match (&raw.layers, &raw.pipeline) {
        (None, _) => None,
        (Some(_), None) => {
            return Err(fail(format!(
                "node '{name}': layers is for a pipeline stage (set pipeline, the group's name)"
            )));
        }
        (Some(l), Some(_)) => Some(parse_layers(l).ok_or_else(|| {
            fail(format!(
                "node '{name}': layers '{l}' is not a range of layers like \"0..12\" (start below end)"
            ))
        })?),
    };
    Ok(Node {
        name: name.clone(),
        role,
        addr: raw.addr.clone(),
        listen,
        bulk_port,
        http,
        metrics,
        pipeline: raw.pipeline.clone(),
        layers,
    })
}

/// `"a..b"` with `a < b`.
fn parse_layers(s: &str) -> Option<std::ops::Range<usize>> {
    let (a, b) = s.trim().split_once("..")?;
    let (a, b): (usize, usize) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
    (a < b).then_some(a..b)
}

/// Checks each pipeline group: two stages or more, one role, and layers
/// on every stage or on none, each stage's following the one before from
/// layer 0. The error names the group.
fn check_groups(nodes: &[Node]) -> Result<(), String> {
    let mut seen: Vec<&str> = Vec::new();
    for n in nodes {
        let Some(g) = n.pipeline.as_deref() else {
            continue;
        };
        if seen.contains(&g) {
            continue;
        }
        seen.push(g);
        let stages: Vec<&Node> = nodes
            .iter()
            .filter(|m| m.pipeline.as_deref() == Some(g))
            .collect();
        if stages.len() < 2 {
            return Err(format!(
                "pipeline '{g}' has one node ('{}'): a group needs two stages or more",
                n.name
            ));
        }
        if let Some(m) = stages.iter().find(|m| m.role != n.role) {
            return Err(format!(
                "pipeline '{g}': node '{}' is a {} and node '{}' a {}: a group's stages share one role",
                n.name, n.role, m.name, m.role
            ));
        }
        let given = stages.iter().filter(|m| m.layers.is_some()).count();
        if given != 0 && given != stages.len() {
            return Err(format!(
                "pipeline '{g}': layers is set on {given} of its {} nodes: set it on all (or on none, to split by cost)",
                stages.len()
            ));
        }
        let mut next = 0;
        for m in &stages {
            if let Some(l) = &m.layers {
                if l.start != next {
                    return Err(format!(
                        "pipeline '{g}': node '{}' runs layers {}..{} but the stage before it ends at layer {next} (stages follow each other in file order, from layer 0)",
                        m.name, l.start, l.end
                    ));
                }
                next = l.end;
            }
        }
    }
    Ok(())
}

/// Whether a node name can be a certificate's DNS name and a file name in
/// certs_dir: the same rule `flotilla certs issue` applies, so a config is
/// refused here rather than at the first dial.
fn node_name_ok(name: &str) -> bool {
    (1..=63).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
        && !name.bytes().all(|b| b.is_ascii_digit())
        // ca.pem and ca.key are the CA's files.
        && !name.eq_ignore_ascii_case("ca")
}

/// Checks a peer address: `ip:port`, `[ipv6]:port` or `dns-name:port`, with a
/// port in 1..=65535 and a host a peer can dial. The error completes the
/// sentence "addr 'X' ...".
fn check_addr(addr: &str) -> Result<(), String> {
    let need_port = "needs a port in 1..=65535 (host:port)";
    if let Ok(sa) = addr.parse::<SocketAddr>() {
        if sa.port() == 0 {
            return Err(need_port.into());
        }
        if sa.ip().is_unspecified() {
            return Err(format!(
                "is not an address peers can dial: set addr to this node's reachable address and listen = \"{sa}\""
            ));
        }
        return Ok(());
    }
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Err(need_port.into());
    };
    match port.parse::<u16>() {
        Ok(p) if p > 0 => {}
        _ => return Err(need_port.into()),
    }
    if host.contains(':') || host.starts_with('[') {
        return Err("is not a valid address (write IPv6 as [addr]:port)".into());
    }
    let label_ok = |l: &str| {
        (1..=63).contains(&l.len())
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if host.is_empty() || host.len() > 253 || !host.split('.').all(label_ok) {
        return Err("has no valid host (an IP address or a DNS name)".into());
    }
    Ok(())
}

/// The host part of a checked addr, lowercased.
fn addr_host(addr: &str) -> String {
    match addr.parse::<SocketAddr>() {
        Ok(sa) => sa.ip().to_string(),
        Err(_) => addr
            .rsplit_once(':')
            .map_or(addr, |(h, _)| h)
            .to_ascii_lowercase(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ClusterConfig;

    const TIERS: &str = "[[tiers]]\nname = \"t\"\n\n";

    const NODES: &str = r#"[[nodes]]
name = "router"
role = "router"
addr = "127.0.0.1:7400"
http = "127.0.0.1:8000"

[[nodes]]
name = "worker-1"
role = "worker"
addr = "127.0.0.1:7401"

[[nodes]]
name = "worker-2"
role = "mixed"
addr = "127.0.0.1:7402"
"#;

    fn sock(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn with_cluster(cluster: &str) -> String {
        format!("{TIERS}[cluster]\n{cluster}\n{NODES}")
    }

    fn parse(text: &str) -> ClusterSection {
        ClusterConfig::parse(text, "c.toml")
            .unwrap_or_else(|e| panic!("{e}\n{text}"))
            .cluster
            .expect("a cluster section")
    }

    /// The line and message of an `Invalid` refusal.
    fn refusal(text: &str) -> (usize, String) {
        match ClusterConfig::parse(text, "c.toml") {
            Err(ConfigError::Invalid { line, message, .. }) => (line, message),
            other => panic!("expected Invalid, got {other:?}\n{text}"),
        }
    }

    /// The 1-based line of the `n`th (0-based) line equal to `header`.
    fn header_line(text: &str, header: &str, n: usize) -> usize {
        text.lines()
            .enumerate()
            .filter(|(_, l)| *l == header)
            .nth(n)
            .unwrap_or_else(|| panic!("no {header} #{n}"))
            .0
            + 1
    }

    /// Asserts a refusal at the `n`th `[[nodes]]` table mentioning `what`.
    fn refused_at_node(text: &str, n: usize, what: &[&str]) {
        let (line, message) = refusal(text);
        assert_eq!(line, header_line(text, "[[nodes]]", n), "{message}");
        for w in what {
            assert!(message.contains(w), "{message:?} lacks {w:?}");
        }
    }

    /// Asserts a refusal at `[cluster]` mentioning `what`.
    fn refused_at_cluster(text: &str, what: &[&str]) {
        let (line, message) = refusal(text);
        assert_eq!(line, header_line(text, "[cluster]", 0), "{message}");
        for w in what {
            assert!(message.contains(w), "{message:?} lacks {w:?}");
        }
    }

    #[test]
    fn joining_is_on_by_default_and_the_revocation_list_is_beside_the_config() {
        let c = parse(&with_cluster(""));
        assert!(c.allow_join);
        assert_eq!(
            (c.revocation_list.as_ref(), c.forget_after_ms),
            (None, 60_000)
        );
        let c = parse(&with_cluster(
            "allow_join = false\nrevocation_list = \"revoked.txt\"\nforget_after_ms = 5000",
        ));
        assert!(!c.allow_join);
        assert_eq!(c.revocation_list, Some(PathBuf::from("revoked.txt")));
        assert_eq!(c.forget_after_ms, 5000);
        refused_at_cluster(
            &with_cluster("forget_after_ms = 10"),
            &["forget_after_ms", "1000"],
        );
        refused_at_cluster(
            &with_cluster("revocation_list = \"\""),
            &["revocation_list"],
        );
        // `load` puts a relative list beside the file, as it does certs_dir.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, with_cluster("revocation_list = \"revoked.txt\"")).unwrap();
        let cfg = crate::ClusterConfig::load(&path).unwrap();
        assert_eq!(
            cfg.cluster.unwrap().revocation_list,
            Some(dir.path().join("revoked.txt"))
        );
    }

    #[test]
    fn admin_keys_are_read_and_must_be_long_and_no_tenant_s() {
        let c = parse(&with_cluster(r#"admin_keys = ["admin-key-0123456789"]"#));
        assert_eq!(c.admin_keys, ["admin-key-0123456789"]);
        assert!(parse(&with_cluster("")).admin_keys.is_empty());
        refused_at_cluster(
            &with_cluster(r#"admin_keys = ["short"]"#),
            &["admin_keys", "16"],
        );
        refused_at_cluster(
            &with_cluster(r#"admin_keys = ["admin key 0123456789"]"#),
            &["whitespace"],
        );
        let tenant =
            "[[tenants]]\nname = \"a\"\ntier = \"t\"\napi_keys = [\"admin-key-0123456789\"]\n\n";
        let text = format!(
            "{tenant}{}",
            with_cluster(r#"admin_keys = ["admin-key-0123456789"]"#)
        );
        refused_at_cluster(&text, &["also a tenant's API key"]);
    }

    /// A router and `nodes` (each `(name, extra keys)`), workers on
    /// ports from 7401.
    fn group_config(nodes: &[(&str, &str)]) -> String {
        let mut t = format!(
            "{TIERS}[[nodes]]\nname = \"router\"\nrole = \"router\"\naddr = \"127.0.0.1:7400\"\nhttp = \"127.0.0.1:8000\"\n"
        );
        for (i, (name, extra)) in nodes.iter().enumerate() {
            t += &format!(
                "\n[[nodes]]\nname = \"{name}\"\nrole = \"worker\"\naddr = \"127.0.0.1:{}\"\n{extra}\n",
                7401 + i
            );
        }
        t
    }

    #[test]
    fn pipeline_groups_are_read_and_checked() {
        let c = parse(&group_config(&[
            ("a", "pipeline = \"g\"\nlayers = \"0..10\""),
            ("b", "pipeline = \"g\"\nlayers = \"10..30\""),
            ("w", ""),
        ]));
        assert_eq!(c.pipeline_activations, "f16");
        let (a, b) = (c.node("a").unwrap(), c.node("b").unwrap());
        assert_eq!((c.stage_of(a), c.stage_of(b)), (Some(0), Some(1)));
        assert_eq!(b.layers, Some(10..30));
        assert_eq!(c.stage_of(c.node("w").unwrap()), None);
        // The Router routes to stage 0 and the whole-model worker only.
        let engines: Vec<&str> = c.engines().map(|(_, n)| n.name.as_str()).collect();
        assert_eq!(engines, ["a", "w"]);
        assert_eq!(c.group("g").len(), 2);
        // Layers may be left to stage 0.
        let c = parse(&group_config(&[
            ("a", "pipeline = \"g\""),
            ("b", "pipeline = \"g\""),
        ]));
        assert_eq!(c.node("b").unwrap().layers, None);
        for (nodes, what) in [
            (vec![("a", "pipeline = \"g\"")], "one node"),
            (
                vec![
                    ("a", "pipeline = \"g\"\nlayers = \"0..10\""),
                    ("b", "pipeline = \"g\""),
                ],
                "on 1 of its 2",
            ),
            (
                vec![
                    ("a", "pipeline = \"g\"\nlayers = \"0..10\""),
                    ("b", "pipeline = \"g\"\nlayers = \"11..30\""),
                ],
                "ends at layer 10",
            ),
            (
                vec![
                    ("a", "pipeline = \"g\"\nlayers = \"2..10\""),
                    ("b", "pipeline = \"g\"\nlayers = \"10..30\""),
                ],
                "ends at layer 0",
            ),
        ] {
            let (_, message) = refusal(&group_config(&nodes));
            assert!(message.contains(what), "{message}");
        }
        for (extra, what) in [
            ("layers = \"0..4\"", "set pipeline"),
            ("pipeline = \"g\"\nlayers = \"4..4\"", "start below end"),
            ("pipeline = \"g\"\nlayers = \"x\"", "not a range"),
            ("pipeline = \"bad name\"", "pipeline 'bad name'"),
        ] {
            let (_, message) = refusal(&group_config(&[("a", extra), ("b", "pipeline = \"g\"")]));
            assert!(message.contains(what), "{extra}: {message}");
        }
        let mixed = group_config(&[("a", "pipeline = \"g\""), ("b", "pipeline = \"g\"")]).replacen(
            "name = \"b\"\nrole = \"worker\"",
            "name = \"b\"\nrole = \"decode\"",
            1,
        );
        assert!(refusal(&mixed).1.contains("share one role"));
        refused_at_cluster(
            &with_cluster("pipeline_activations = \"bf16\""),
            &["f16 or f32"],
        );
        assert_eq!(
            parse(&with_cluster("pipeline_activations = \"f32\"")).pipeline_activations,
            "f32"
        );
    }

    #[test]
    fn no_cluster_is_none() {
        let c = ClusterConfig::parse(TIERS, "c.toml").unwrap();
        assert_eq!(c.cluster, None);
        assert_eq!(ClusterConfig::open().cluster, None);
    }

    #[test]
    fn nodes_without_cluster_take_defaults() {
        let c = parse(&format!("{TIERS}{NODES}"));
        assert_eq!(c.certs_dir, PathBuf::from("certs"));
        assert_eq!(c.heartbeat_interval_ms, 500);
        assert_eq!(c.down_after_missed, 3);
        assert_eq!(c.frame_len_max_bytes, 1 << 20);
        assert_eq!(c.send_queue_len_max, 4096);
        assert_eq!(c.reconnect_backoff_max_ms, 2000);
        assert_eq!(c.idle_timeout_ms, 10_000);
        assert_eq!(c.down_after(), Duration::from_millis(1500));
        assert_eq!(c.nodes.len(), 3);
        let (id, router) = c.router();
        assert_eq!((id, router.name.as_str()), (0, "router"));
        assert_eq!(router.http, Some(sock("127.0.0.1:8000")));
        assert_eq!(router.listen, sock("127.0.0.1:7400"));
        let engines: Vec<(u32, &str)> = c.engines().map(|(i, n)| (i, n.name.as_str())).collect();
        assert_eq!(engines, [(1, "worker-1"), (2, "worker-2")]);
        assert_eq!(
            c.node("worker-2").unwrap().role,
            Role::Worker,
            "mixed is worker"
        );
        assert_eq!(c.node_id("worker-2"), Some(2));
        assert_eq!(c.node_id("nope"), None);
        assert!(c.node("nope").is_none());
    }

    #[test]
    fn cluster_settings_are_read() {
        let c = parse(&with_cluster(
            r#"certs_dir = "/etc/flotilla/certs"
heartbeat_interval_ms = 100
down_after_missed = 5
frame_len_max_bytes = 4096
send_queue_len_max = 8
reconnect_backoff_max_ms = 50
idle_timeout_ms = 200
"#,
        ));
        assert_eq!(c.certs_dir, PathBuf::from("/etc/flotilla/certs"));
        assert_eq!(c.heartbeat_interval_ms, 100);
        assert_eq!(c.down_after_missed, 5);
        assert_eq!(c.frame_len_max_bytes, 4096);
        assert_eq!(c.send_queue_len_max, 8);
        assert_eq!(c.reconnect_backoff_max_ms, 50);
        assert_eq!(c.idle_timeout_ms, 200);
        assert_eq!(c.down_after(), Duration::from_millis(500));
    }

    #[test]
    fn host_name_addr_with_listen_and_prefill_decode_roles() {
        let text = format!(
            r#"{TIERS}[[nodes]]
name = "router"
role = "router"
addr = "flotilla-router:7400"
listen = "0.0.0.0:7400"
http = "0.0.0.0:8000"

[[nodes]]
name = "p-0"
role = "prefill"
addr = "p-0.flotilla-worker:7400"
listen = "0.0.0.0:7400"

[[nodes]]
name = "d-0"
role = "decode"
addr = "[::1]:7402"
"#
        );
        let c = parse(&text);
        assert_eq!(c.nodes[1].role, Role::Prefill);
        assert_eq!(c.nodes[1].listen, sock("0.0.0.0:7400"));
        assert_eq!(c.nodes[2].role, Role::Decode);
        assert_eq!(c.nodes[2].listen, sock("[::1]:7402"));
        assert_eq!(c.engines().count(), 2);
    }

    #[test]
    fn refuses_cluster_without_nodes() {
        let text = format!("{TIERS}[cluster]\nheartbeat_interval_ms = 100\n");
        refused_at_cluster(&text, &["[cluster] has no nodes"]);
    }

    #[test]
    fn refuses_out_of_range_numbers() {
        for (field, bad, range) in [
            ("heartbeat_interval_ms", "9", "10..=60000"),
            ("heartbeat_interval_ms", "60001", "10..=60000"),
            ("down_after_missed", "0", "1..=100"),
            ("down_after_missed", "101", "1..=100"),
            ("frame_len_max_bytes", "4095", "4096..=268435456"),
            ("frame_len_max_bytes", "268435457", "4096..=268435456"),
            ("send_queue_len_max", "0", "1..=1048576"),
            ("send_queue_len_max", "-1", "1..=1048576"),
            ("reconnect_backoff_max_ms", "9", "10..=60000"),
            ("reconnect_backoff_max_ms", "60001", "10..=60000"),
            ("idle_timeout_ms", "600001", "10..=600000"),
        ] {
            let text = with_cluster(&format!("{field} = {bad}\n"));
            refused_at_cluster(
                &text,
                &[
                    &format!("cluster.{field} = {bad}"),
                    &format!("out of range {range}"),
                ],
            );
        }
    }

    #[test]
    fn refuses_idle_timeout_under_two_heartbeats() {
        let text = with_cluster("heartbeat_interval_ms = 1000\nidle_timeout_ms = 1999\n");
        refused_at_cluster(
            &text,
            &["idle_timeout_ms = 1999", "2 * heartbeat_interval_ms (2000)"],
        );
        parse(&with_cluster(
            "heartbeat_interval_ms = 1000\nidle_timeout_ms = 2000\n",
        ));
    }

    #[test]
    fn refuses_empty_certs_dir() {
        refused_at_cluster(&with_cluster("certs_dir = \"\"\n"), &["certs_dir is empty"]);
    }

    #[test]
    fn refuses_unknown_cluster_and_node_fields() {
        let e = ClusterConfig::parse(&with_cluster("heartbeat_ms = 5\n"), "c.toml").unwrap_err();
        assert!(e.to_string().contains("heartbeat_ms"), "{e}");
        let text = with_cluster("").replace("name = \"worker-1\"", "name = \"worker-1\"\nport = 1");
        let e = ClusterConfig::parse(&text, "c.toml").unwrap_err();
        assert!(e.to_string().contains("port"), "{e}");
    }

    #[test]
    fn refuses_duplicate_node_name() {
        let text = with_cluster("").replace("\"worker-2\"", "\"worker-1\"");
        refused_at_node(&text, 2, &["node 'worker-1' is defined twice"]);
        let text = with_cluster("").replace("\"worker-2\"", "\"Worker-1\"");
        refused_at_node(
            &text,
            2,
            &[
                "node 'Worker-1' is defined twice",
                "node 'worker-1' differs only in case",
            ],
        );
    }

    #[test]
    fn refuses_too_many_nodes() {
        let mut text = format!("{TIERS}{NODES}");
        for i in 3..=NODES_MAX {
            text.push_str(&format!(
                "\n[[nodes]]\nname = \"w{i}\"\nrole = \"worker\"\naddr = \"127.0.0.1:{}\"\n",
                10_000 + i
            ));
        }
        let (line, message) = refusal(&text);
        assert_eq!(line, header_line(&text, "[[nodes]]", 0), "{message}");
        assert!(message.contains("1025 nodes: at most 1024"), "{message}");
        // One fewer is accepted.
        let cut = text.rfind("\n[[nodes]]").unwrap();
        assert_eq!(parse(&text[..cut]).nodes.len(), NODES_MAX);
    }

    #[test]
    fn refuses_duplicate_addr() {
        let text = with_cluster("").replace("127.0.0.1:7402", "127.0.0.1:7401");
        refused_at_node(
            &text,
            2,
            &[
                "node 'worker-2'",
                "addr '127.0.0.1:7401'",
                "node 'worker-1'",
            ],
        );
        let text = format!("{TIERS}{NODES}")
            .replace(
                "addr = \"127.0.0.1:7401\"",
                "addr = \"w:7400\"\nlisten = \"0.0.0.0:7401\"",
            )
            .replace(
                "addr = \"127.0.0.1:7402\"",
                "addr = \"W:7400\"\nlisten = \"0.0.0.0:7402\"",
            );
        refused_at_node(&text, 2, &["addr 'W:7400' is also node 'worker-1''s"]);
    }

    #[test]
    fn an_engine_node_may_have_a_metrics_address_and_the_router_may_not() {
        let c = parse(&format!("{TIERS}{NODES}").replace(
            "addr = \"127.0.0.1:7402\"",
            "addr = \"127.0.0.1:7402\"\nmetrics = \"0.0.0.0:9402\"",
        ));
        assert_eq!(c.nodes[2].metrics, Some("0.0.0.0:9402".parse().unwrap()));
        assert!(c.nodes[..2].iter().all(|n| n.metrics.is_none()));
        for (bad, why) in [
            ("metrics = \"9402\"", "is not a socket address"),
            ("metrics = \"0.0.0.0:0\"", "needs a port"),
        ] {
            let text = format!("{TIERS}{NODES}").replace(
                "addr = \"127.0.0.1:7402\"",
                &format!("addr = \"127.0.0.1:7402\"\n{bad}"),
            );
            refused_at_node(&text, 2, &["node 'worker-2'", why]);
        }
        let text = format!("{TIERS}{NODES}").replace(
            "addr = \"127.0.0.1:7400\"",
            "addr = \"127.0.0.1:7400\"\nmetrics = \"127.0.0.1:9400\"",
        );
        refused_at_node(&text, 0, &["node 'router'", "metrics is for engine nodes"]);
    }

    #[test]
    fn bulk_port_is_any_free_port_unless_set_and_refused_out_of_range() {
        let c = parse(&format!("{TIERS}{NODES}"));
        assert!(c.nodes.iter().all(|n| n.bulk_port == 0));
        let set = format!("{TIERS}{NODES}").replace(
            "addr = \"127.0.0.1:7402\"",
            "addr = \"127.0.0.1:7402\"\nbulk_port = 7502",
        );
        assert_eq!(parse(&set).nodes[2].bulk_port, 7502);
        for bad in ["0", "70000", "-1", "7402"] {
            let text = format!("{TIERS}{NODES}").replace(
                "addr = \"127.0.0.1:7402\"",
                &format!("addr = \"127.0.0.1:7402\"\nbulk_port = {bad}"),
            );
            refused_at_node(&text, 2, &["node 'worker-2'", &format!("bulk_port {bad}")]);
        }
    }

    #[test]
    fn refuses_duplicate_listen() {
        // Two nodes on one IP cannot both bind it.
        let text = format!("{TIERS}{NODES}").replace(
            "addr = \"127.0.0.1:7402\"",
            "addr = \"127.0.0.1:7402\"\nlisten = \"127.0.0.1:7401\"",
        );
        refused_at_node(
            &text,
            2,
            &[
                "node 'worker-2'",
                "listen 127.0.0.1:7401",
                "node 'worker-1'",
            ],
        );
        // 0.0.0.0:7400 on two hosts is fine; on one host it collides.
        let two_hosts = format!("{TIERS}{NODES}")
            .replace(
                "addr = \"127.0.0.1:7401\"",
                "addr = \"w1:7400\"\nlisten = \"0.0.0.0:7400\"",
            )
            .replace(
                "addr = \"127.0.0.1:7402\"",
                "addr = \"w2:7400\"\nlisten = \"0.0.0.0:7400\"",
            );
        parse(&two_hosts);
        let one_host = two_hosts.replace("\"w2:7400\"", "\"w1:7401\"");
        refused_at_node(
            &one_host,
            2,
            &["listen 0.0.0.0:7400 is also node 'worker-1''s"],
        );
    }

    #[test]
    fn refuses_no_router_and_takes_two() {
        let none = with_cluster("").replace("role = \"router\"\n", "role = \"worker\"\n");
        let none = none.replace("http = \"127.0.0.1:8000\"\n", "");
        refused_at_cluster(&none, &["no router"]);
        // Without [cluster], the whole-cluster line is the first node's.
        let none = none.replace("[cluster]\n", "");
        refused_at_node(&none, 0, &["no router"]);

        let two = with_cluster("").replace(
            "role = \"worker\"\naddr = \"127.0.0.1:7401\"",
            "role = \"router\"\naddr = \"127.0.0.1:7401\"\nhttp = \"127.0.0.1:8001\"",
        );
        let c = parse(&two);
        let routers: Vec<(u32, &str)> = c.routers().map(|(i, n)| (i, n.name.as_str())).collect();
        assert_eq!(routers, [(0, "router"), (1, "worker-1")]);
        assert_eq!(c.router().0, 0, "the first router is the first in the file");
        assert_eq!(c.router_share("worker-1"), Some((1, 2)));
        assert_eq!(c.router_share("router"), Some((0, 2)));
        assert_eq!(c.router_share("worker-2"), None, "an engine holds no share");
        let engines: Vec<u32> = c.engines().map(|(i, _)| i).collect();
        assert_eq!(engines, [2]);
        // A second router needs its own API address, as the first does.
        let no_http = two.replace("http = \"127.0.0.1:8001\"\n", "");
        refused_at_node(&no_http, 1, &["http"]);
        let same = two.replace("127.0.0.1:8001", "127.0.0.1:8000");
        refused_at_node(&same, 1, &["http 127.0.0.1:8000 is also node 'router''s"]);
    }

    #[test]
    fn refuses_router_only() {
        let text = format!(
            "{TIERS}[cluster]\n\n{}",
            &NODES[..NODES.find("\n\n").unwrap()]
        );
        // Workers may all join at run time; with joining off, one is needed.
        assert!(ClusterConfig::parse(&text, "c.toml").is_ok());
        let off = text.replace("[cluster]\n", "[cluster]\nallow_join = false\n");
        refused_at_cluster(&off, &["no engine node and allow_join = false"]);
    }

    #[test]
    fn refuses_prefill_without_decode() {
        let text = with_cluster("")
            .replace("role = \"worker\"", "role = \"prefill\"")
            .replace("role = \"mixed\"", "role = \"prefill\"");
        refused_at_cluster(&text, &["prefill nodes but no decode node"]);
        let ok = with_cluster("")
            .replace("role = \"worker\"", "role = \"prefill\"")
            .replace("role = \"mixed\"", "role = \"decode\"");
        let c = ClusterConfig::parse(&ok, "c.toml").unwrap();
        let roles: Vec<Role> = c.cluster.unwrap().nodes.iter().map(|n| n.role).collect();
        assert_eq!(roles, [Role::Router, Role::Prefill, Role::Decode]);
    }

    #[test]
    fn refuses_router_without_http_and_http_elsewhere() {
        let text = with_cluster("").replace("http = \"127.0.0.1:8000\"\n", "");
        refused_at_node(&text, 0, &["node 'router'", "needs http"]);
        let text = with_cluster("").replace(
            "addr = \"127.0.0.1:7402\"",
            "addr = \"127.0.0.1:7402\"\nhttp = \"127.0.0.1:8002\"",
        );
        refused_at_node(
            &text,
            2,
            &["node 'worker-2'", "http is only for the router", "worker"],
        );
        let text = with_cluster("").replace("\"127.0.0.1:8000\"", "\"localhost:8000\"");
        refused_at_node(
            &text,
            0,
            &[
                "node 'router'",
                "http 'localhost:8000' is not a socket address",
            ],
        );
    }

    #[test]
    fn refuses_bad_name() {
        for bad in [
            "",
            "worker_1",
            "wörker",
            "-worker",
            "worker-",
            "1234",
            "CA",
            &"w".repeat(64),
        ] {
            let text = with_cluster("").replace("\"worker-1\"", &format!("\"{bad}\""));
            refused_at_node(&text, 1, &[&format!("node name '{bad}' must be 1 to 63")]);
        }
        for good in ["W".repeat(63), "1a".into(), "cab".into()] {
            parse(&with_cluster("").replace("\"worker-1\"", &format!("\"{good}\"")));
        }
    }

    #[test]
    fn refuses_bad_role() {
        let text = with_cluster("").replace("\"mixed\"", "\"gpu\"");
        refused_at_node(
            &text,
            2,
            &["node 'worker-2': role: unknown role 'gpu' (expected router"],
        );
    }

    #[test]
    fn refuses_addr_without_valid_port() {
        for bad in [
            "127.0.0.1",
            "127.0.0.1:0",
            "127.0.0.1:65536",
            "w1",
            "w1:",
            "w1:0",
            "w1:x",
            ":7401",
            "::1",
            "[::1]:0",
            "bad_host:7401",
            "0.0.0.0:7401",
        ] {
            let text = with_cluster("").replace("\"127.0.0.1:7401\"", &format!("\"{bad}\""));
            refused_at_node(&text, 1, &[&format!("node 'worker-1': addr '{bad}'")]);
        }
        let text = with_cluster("").replace("\"127.0.0.1:7401\"", "\"w1\"");
        refused_at_node(&text, 1, &["needs a port in 1..=65535"]);
    }

    #[test]
    fn refuses_host_name_addr_without_listen() {
        let text = with_cluster("").replace("\"127.0.0.1:7401\"", "\"worker-1.local:7401\"");
        refused_at_node(
            &text,
            1,
            &["node 'worker-1': addr 'worker-1.local:7401' is a host name, set listen"],
        );
    }

    #[test]
    fn refuses_bad_listen() {
        for bad in ["w1:7401", "0.0.0.0", "0.0.0.0:0"] {
            let text = with_cluster("").replace(
                "addr = \"127.0.0.1:7401\"",
                &format!("addr = \"127.0.0.1:7401\"\nlisten = \"{bad}\""),
            );
            refused_at_node(&text, 1, &[&format!("node 'worker-1': listen '{bad}'")]);
        }
    }

    #[test]
    fn load_resolves_relative_certs_dir() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("configs");
        std::fs::create_dir(&sub).unwrap();
        let path = sub.join("c.toml");
        std::fs::write(&path, with_cluster("certs_dir = \"../certs/two\"\n")).unwrap();
        let c = ClusterConfig::load(&path).unwrap().cluster.unwrap();
        assert_eq!(c.certs_dir, sub.join("../certs/two"));
        // parse() keeps the path as written.
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(parse(&text).certs_dir, PathBuf::from("../certs/two"));

        // The default is relative too; an absolute path is kept.
        std::fs::write(&path, format!("{TIERS}{NODES}")).unwrap();
        let c = ClusterConfig::load(&path).unwrap().cluster.unwrap();
        assert_eq!(c.certs_dir, sub.join("certs"));
        std::fs::write(&path, with_cluster("certs_dir = \"/etc/flotilla/certs\"\n")).unwrap();
        let c = ClusterConfig::load(&path).unwrap().cluster.unwrap();
        assert_eq!(c.certs_dir, PathBuf::from("/etc/flotilla/certs"));
    }
}

#[cfg(test)]
mod settings_tests {
    use super::*;

    #[test]
    fn defaults_are_the_config_files_and_a_built_section_is_checked_the_same_way() {
        let d = ClusterSection::defaults();
        assert_eq!((d.heartbeat_interval_ms, d.down_after_missed), (500, 3));
        assert_eq!((d.kv_hold_ttl_ms, d.kv_transfers_max), (30_000, 2));
        assert_eq!(d.check(), Ok(()));
        let mut s = d.clone();
        s.heartbeat_interval_ms = 5;
        assert_eq!(
            s.check(),
            Err("cluster.heartbeat_interval_ms = 5 is out of range 10..=60000".into())
        );
        let mut s = d.clone();
        s.heartbeat_interval_ms = 6000;
        assert!(
            s.check()
                .unwrap_err()
                .contains("idle_timeout_ms = 10000 must be at least")
        );
        let mut s = d;
        s.kv_transfers_max = 0;
        assert!(s.check().unwrap_err().contains("kv_transfers_max = 0"));
    }
}
