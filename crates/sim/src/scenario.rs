//! Scenario files (`simulations/*.toml`): the cluster, the hardware, the
//! workload and the faults of one simulation.

use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;

use crate::cost::{GpuParams, ModelShape};
use flotilla_transport::sim::LinkConfig;

/// One scenario: its own tables (the run, the hardware, where the nodes
/// are, the network, the traffic and the objectives, the faults) and a
/// cluster config's (`[engine]`, `[[tiers]]`, `[[tenants]]`, `[cluster]`),
/// which `flotilla_config` reads as it reads a config file: the same keys,
/// the same checks, the same errors naming line and field.
#[derive(Clone, Debug)]
pub struct Scenario {
    /// Length of the run.
    pub run: RunSection,
    /// The model (a preset name or every field).
    pub model: Named,
    /// The accelerator of every engine node (a preset name or every field).
    pub gpu: Named,
    /// The config tables: tiers, tenants (weights, quotas, reservations
    /// as a config sets them), `[engine]` and `[cluster]` as written.
    pub config: flotilla_config::ClusterConfig,
    /// `[engine]` resolved over the simulator's defaults
    /// ([`sim_engine_defaults`]) by the code `flotilla serve` resolves it
    /// with; `[flags] batching` is the flag the file cannot set.
    pub engine: flotilla_config::engine::EngineSettings,
    /// Longest prompt + output (`[engine] max_model_len`, default 4096).
    pub max_model_len: usize,
    /// `[cluster]`: heartbeat, down bound, transfer limits, frame cap,
    /// idle timeout (a cluster config's defaults where not set).
    pub cluster: flotilla_config::ClusterSection,
    /// How many engine nodes of each role.
    pub topology: Topology,
    /// Link figures and per-message fault rates (its frame cap and idle
    /// timeout are `[cluster]`'s).
    pub network: LinkConfig,
    /// Each tier's latency objective, in tier order.
    pub slos: Vec<SloSection>,
    /// Each tenant's traffic, in tenant order.
    pub traffic: Vec<TrafficSection>,
    /// Scheduled faults.
    pub faults: Vec<FaultSection>,
    /// Faults drawn by the seed, beside the scheduled ones.
    pub chaos: Option<crate::chaos::ChaosSection>,
    /// Every engine node a pipeline group (`[pipeline]`), or none.
    pub pipeline: Option<PipelineSection>,
    /// How the simulator advances time (`[sim]`).
    pub sim: SimSection,
}

/// The scenario's own top-level tables, read by serde; the config's are
/// read by `flotilla_config` ([`ClusterConfig::parse_embedded`]).
///
/// [`ClusterConfig::parse_embedded`]: flotilla_config::ClusterConfig::parse_embedded
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawScenario {
    run: RunSection,
    model: Named,
    gpu: Named,
    #[serde(default)]
    topology: Topology,
    #[serde(default)]
    flags: Flags,
    #[serde(default)]
    network: LinkConfig,
    #[serde(default)]
    slos: Vec<SloSection>,
    #[serde(default)]
    traffic: Vec<TrafficSection>,
    #[serde(default)]
    faults: Vec<FaultSection>,
    #[serde(default)]
    chaos: Option<crate::chaos::ChaosSection>,
    #[serde(default)]
    pipeline: Option<PipelineSection>,
    #[serde(default)]
    sim: SimSection,
    // The config's tables: `flotilla_config` reads them.
    #[serde(default, rename = "engine")]
    _engine: serde::de::IgnoredAny,
    #[serde(default, rename = "tiers")]
    _tiers: serde::de::IgnoredAny,
    #[serde(default, rename = "tenants")]
    _tenants: serde::de::IgnoredAny,
    #[serde(default, rename = "cluster")]
    _cluster: serde::de::IgnoredAny,
}

/// The scenario's own top-level tables (beside the config's).
const OWN_TABLES: [&str; 12] = [
    "run", "model", "gpu", "topology", "flags", "network", "slos", "traffic", "faults", "chaos",
    "pipeline", "sim",
];

/// What the simulator takes where `[engine]` says nothing: a GPU
/// server's batch sizes (not the CPU's `flotilla serve` defaults), no
/// speculation (the simulated tokens are random, so a draft almost never
/// matches).
pub fn sim_engine_defaults() -> flotilla_config::engine::EngineDefaults {
    flotilla_config::engine::EngineDefaults {
        max_num_seqs: 256,
        max_num_batched_tokens: 2048,
        block_size: 16,
        queue_timeout_s: 60.0,
        speculation: flotilla_sched::Speculation::OFF,
        step_time_max_ms: None,
    }
}

/// Longest prompt + output where `[engine] max_model_len` is not set.
pub const MAX_MODEL_LEN_DEFAULT: usize = 4096;

/// How long arrivals go on, and how long the run may take to drain.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunSection {
    /// Arrivals stop after this many simulated seconds.
    pub duration_s: f64,
    /// Simulated seconds after that for in-flight requests to end.
    #[serde(default = "default_drain")]
    pub drain_s: f64,
    /// The checks that cost something every step: every scheduler
    /// invariant (KV accounting on every pool among them) after every
    /// message each Scheduler handles, and the log of which engine decoded
    /// which request when (for "no request decoding on two engines at
    /// once"). On unless turned off for speed.
    #[serde(default = "yes")]
    pub check_every_step: bool,
}

fn yes() -> bool {
    true
}

fn default_drain() -> f64 {
    300.0
}

/// A preset by name (with any of its fields set otherwise), or a full
/// parameter set.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Named {
    /// `{ preset = "h200" }`, or `{ preset = "cpu", mem_bytes = 1.9e8 }`:
    /// the preset with the fields given beside its name replaced.
    Preset {
        /// The preset's name.
        preset: String,
        /// Fields of the preset set otherwise (each one a field of the
        /// GPU or model figures; any other key is refused).
        #[serde(flatten)]
        set: toml::Table,
    },
    /// Every field of a GPU or model.
    Gpu(GpuParams),
    /// Every field of a model.
    Model(ModelShape),
}

/// `base` (a preset) with the fields in `set` replaced; a key that is
/// not one of its fields, or a value of the wrong type, is refused naming
/// `[section]`.
fn with_fields<T: serde::Serialize + serde::de::DeserializeOwned>(
    base: T,
    set: &toml::Table,
    section: &str,
) -> Result<T, ScenarioError> {
    if set.is_empty() {
        return Ok(base);
    }
    let bad = |e: String| ScenarioError::Invalid(format!("[{section}]: {e}"));
    let mut fields = toml::Table::try_from(base).map_err(|e| bad(e.to_string()))?;
    for (k, v) in set {
        fields.insert(k.clone(), v.clone());
    }
    toml::Value::Table(fields)
        .try_into()
        .map_err(|e: toml::de::Error| bad(e.message().to_string()))
}

/// The one table of `tables` that names each of `names`, in their order;
/// a name with none or two, or a table naming none of them, is refused
/// (`what` = the kind of name and the tables' header).
fn one_each<T: Clone>(
    tables: &[T],
    names: &[&str],
    name_of: impl Fn(&T) -> &String,
    (kind, header): (&str, &str),
) -> Result<Vec<T>, ScenarioError> {
    let bad = |m: String| Err(ScenarioError::Invalid(m));
    let mut out = Vec::with_capacity(names.len());
    for n in names {
        let mut mine = tables.iter().filter(|t| name_of(t) == n);
        match (mine.next(), mine.next()) {
            (Some(t), None) => out.push(t.clone()),
            (None, _) => return bad(format!("{kind} '{n}' has no {header} table")),
            (Some(_), Some(_)) => return bad(format!("{kind} '{n}' has two {header} tables")),
        }
    }
    if let Some(t) = tables
        .iter()
        .find(|t| !names.contains(&name_of(t).as_str()))
    {
        return bad(format!("{header} names unknown {kind} '{}'", name_of(t)));
    }
    Ok(out)
}

/// What `flotilla serve` takes as flags only (a config file cannot set it).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Flags {
    /// `--batching`: `continuous` or `static`.
    pub batching: String,
}

impl Default for Flags {
    fn default() -> Self {
        Flags {
            batching: "continuous".into(),
        }
    }
}

/// The nodes: node 0 is the first Router; then the mixed engines, then
/// the prefill nodes, then the decode nodes, then the other Routers.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Topology {
    /// Mixed engine nodes (whole requests).
    pub engines: usize,
    /// Prefill nodes (disaggregated serving; needs decode nodes).
    pub prefill: usize,
    /// Decode nodes.
    pub decode: usize,
    /// Routers (1..=8): each places on every engine, the engines admit
    /// from all; clients go to the Routers that are up in turn, as a load
    /// balancer spreads them.
    pub routers: usize,
    /// Of the mixed engines, the last this many are in no config: they
    /// join at run time (a `join` fault, or `[chaos] joins`), the Routers
    /// learning of them from their connection, and leave by draining.
    pub joiners: usize,
}

impl Default for Topology {
    /// One engine.
    fn default() -> Self {
        Topology {
            engines: 1,
            prefill: 0,
            decode: 0,
            routers: 1,
            joiners: 0,
        }
    }
}

/// `[sim]`: how the simulator advances time.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SimSection {
    /// `exact` (the default) or `fast` (`flotilla simulate --fast`).
    pub mode: SimMode,
}

/// How the simulator advances time.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum SimMode {
    /// Every engine step is its own event, with its tokens' messages (as
    /// the scenario's `[engine] decode_steps` says): the test mode, whose
    /// trace hashes the tests hold.
    #[default]
    Exact,
    /// The same actors make the same decisions at every arrival, finish,
    /// preemption and fault; between them an engine's steady decode runs
    /// as one plan of up to `DECODE_STEPS_MAX` steps, its tokens reaching
    /// their clients together at the plan's end (each with the time its
    /// step ended). Around each scheduled or drawn fault it runs step by
    /// step ([`Scenario::exact_spans`]). Per request the outcome, TTFT,
    /// TPOT and finish equal the exact mode's (`sim::compare`).
    Fast,
}

/// How long before a fault fast mode goes step by step, beyond the
/// longest decode step: a plan in flight then ends before the fault.
const EXACT_LEAD: std::time::Duration = std::time::Duration::from_millis(500);

/// `[pipeline]`: every engine node is a pipeline group (issue 45) of
/// `stages` stages over links of their own, the layers split evenly
/// (`exec::PipeModel`). Stage 0 is the node (its Scheduler, embedding,
/// head and sampling); `stage_crash` and `stage_restart` faults and
/// `[chaos] stage_crashes` take later stages down and back.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipelineSection {
    /// Stages of each group (2 and up, at most the model's layers).
    pub stages: usize,
    /// One hop's latency between two stages, us.
    #[serde(default = "default_hop_latency_us")]
    pub hop_latency_us: f64,
    /// A stage link's bandwidth, Gbit/s.
    #[serde(default = "default_link_gbps")]
    pub link_gbps: f64,
    /// How hidden rows cross a hop: `f16` (2 bytes a feature) or `f32`.
    #[serde(default = "default_activations")]
    pub activations: String,
}

fn default_hop_latency_us() -> f64 {
    100.0
}

fn default_link_gbps() -> f64 {
    10.0
}

fn default_activations() -> String {
    "f16".into()
}

/// A tier's latency objective: a finished request meets it if its TTFT
/// is at most `ttft_ms` and its mean TPOT at most `tpot_ms` (goodput).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SloSection {
    /// The tier (a `[[tiers]]` name).
    pub tier: String,
    /// Time to first token, ms.
    pub ttft_ms: f64,
    /// Mean time per output token, ms.
    pub tpot_ms: f64,
}

/// A tenant's traffic.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrafficSection {
    /// The tenant (a `[[tenants]]` name).
    pub tenant: String,
    /// How requests arrive.
    pub arrivals: Arrivals,
    /// Prompt lengths, tokens (a trace's lines give their own).
    #[serde(default = "Lengths::unset")]
    pub prompt: Lengths,
    /// Output lengths, tokens (a trace's lines give their own).
    #[serde(default = "Lengths::unset")]
    pub output: Lengths,
    /// Fraction of requests whose client leaves mid-stream.
    #[serde(default)]
    pub cancel_fraction: f64,
    /// Fraction of requests under an output constraint (structured
    /// outputs, required tool calls): each of their samples needs a token
    /// mask, which costs the accelerator's `mask_us`.
    #[serde(default)]
    pub constrained_fraction: f64,
    /// With a draft model (`[engine] draft_model`): how often its guess at
    /// this tenant's next token is right, per token (the simulated tokens
    /// are random, so the verify draws it). Code and edits run high, chat
    /// lower.
    #[serde(default = "default_draft_acceptance")]
    pub draft_acceptance: f64,
}

fn default_draft_acceptance() -> f64 {
    0.7
}

/// An arrival process.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, tag = "kind", rename_all = "snake_case")]
pub enum Arrivals {
    /// Poisson arrivals at `rate_per_s`.
    Poisson {
        /// Mean arrivals per second.
        rate_per_s: f64,
    },
    /// `clients` clients, each sending its next request when the last ends.
    Closed {
        /// Concurrent clients.
        clients: usize,
        /// Stop after this many requests in all (as `flotilla bench
        /// --requests`); otherwise at the end of the run.
        #[serde(default)]
        requests: Option<usize>,
    },
    /// Poisson at `rate_per_s`, with bursts of `burst` requests at once
    /// every `every_s` seconds.
    Bursts {
        /// Background rate.
        rate_per_s: f64,
        /// Requests per burst.
        burst: usize,
        /// Seconds between bursts.
        every_s: f64,
    },
    /// A recorded trace replayed: a JSONL file, one request a line,
    /// `{"t": 0.25, "prompt_tokens": 812, "output_tokens": 140, "tenant":
    /// "acme"}` (`t`: seconds from the trace's start), of which this
    /// tenant's lines; its times divided by `speed`, the trace looped to
    /// fill `[run] duration_s`. Each request's lengths are its line's (the
    /// traffic's `prompt` and `output` may be left out).
    Trace {
        /// The file, relative to the scenario's directory.
        file: String,
        /// Replay speed (2: twice the trace's rate).
        #[serde(default = "one")]
        speed: f64,
        /// This tenant's lines, read when the scenario is loaded.
        #[serde(skip)]
        rows: Arc<Vec<TraceRow>>,
        /// One loop of the whole trace (every tenant's lines), seconds.
        #[serde(skip)]
        period_s: f64,
    },
}

fn one() -> f64 {
    1.0
}

/// One request of a trace.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceRow {
    /// Seconds from the trace's start.
    pub t: f64,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Output tokens.
    pub output_tokens: u32,
    /// The tenant's name.
    pub tenant: String,
}

/// The rows of a JSONL trace, each checked, in time order.
pub fn read_trace(path: &Path) -> Result<Vec<TraceRow>, ScenarioError> {
    let text = std::fs::read_to_string(path).map_err(|err| ScenarioError::Read {
        path: path.display().to_string(),
        err,
    })?;
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |why: String| {
            ScenarioError::Invalid(format!("{} line {}: {why}", path.display(), i + 1))
        };
        let r: TraceRow = serde_json::from_str(line).map_err(|e| bad(e.to_string()))?;
        if !(r.t.is_finite() && r.t >= 0.0) {
            return Err(bad(format!("t {} is not a time >= 0", r.t)));
        }
        if r.prompt_tokens == 0 || r.output_tokens == 0 {
            return Err(bad(
                "prompt_tokens and output_tokens must be at least 1".into()
            ));
        }
        rows.push(r);
    }
    if rows.is_empty() {
        return Err(ScenarioError::Invalid(format!(
            "{}: the trace holds no requests",
            path.display()
        )));
    }
    rows.sort_by(|a, b| a.t.total_cmp(&b.t));
    Ok(rows)
}

impl Lengths {
    /// No lengths given (refused unless a trace gives them).
    fn unset() -> Lengths {
        Lengths::Fixed { tokens: 0 }
    }
}

/// A length distribution, in tokens (clamped to `min..=max`).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, tag = "kind", rename_all = "snake_case")]
pub enum Lengths {
    /// Always `tokens`.
    Fixed {
        /// The length.
        tokens: u32,
    },
    /// `exp(mu + sigma * N(0, 1))`, clamped.
    Lognormal {
        /// Mean of the log.
        mu: f64,
        /// Standard deviation of the log.
        sigma: f64,
        /// Smallest length.
        min: u32,
        /// Largest length.
        max: u32,
    },
    /// Uniform in `min..=max`.
    Uniform {
        /// Smallest length.
        min: u32,
        /// Largest length.
        max: u32,
    },
}

/// A fault at a point of the run (unknown fields are refused by
/// [`FaultKind`]'s variants; `flatten` rules out `deny_unknown_fields` here).
#[derive(Clone, Debug, Deserialize)]
pub struct FaultSection {
    /// When, simulated seconds from the start.
    pub at_s: f64,
    /// What.
    #[serde(flatten)]
    pub kind: FaultKind,
}

/// The faults a scenario can schedule.
#[derive(Clone, Debug, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum FaultKind {
    /// Stage `stage` (1..) of pipeline group `node` dies: the group's
    /// steps fail, its requests move, and it serves again once the stage
    /// is back (`stage_restart`).
    StageCrash {
        /// The group's node id.
        node: u32,
        /// The stage.
        stage: usize,
    },
    /// A crashed stage comes back; its group forms again.
    StageRestart {
        /// The group's node id.
        node: u32,
        /// The stage.
        stage: usize,
    },
    /// Engine node `node` dies (its engine and its link).
    Crash {
        /// Node id (1.. are engines).
        node: u32,
    },
    /// Engine node `node` drains (as on SIGTERM): no new work, what runs
    /// may finish for `grace_ms`, then it leaves and the Router moves what
    /// still runs there. A `restart` brings it back.
    Drain {
        /// Node id.
        node: u32,
        /// How long its running requests may take, simulated ms.
        grace_ms: u64,
    },
    /// A crashed (or drained) engine node starts again, empty, with a new
    /// epoch.
    Restart {
        /// Node id.
        node: u32,
    },
    /// Cut `a -> b` (and `b -> a` unless `one_way`).
    Partition {
        /// One end.
        a: u32,
        /// The other.
        b: u32,
        /// Only `a -> b`.
        #[serde(default)]
        one_way: bool,
    },
    /// Restore every cut link.
    Heal,
    /// Router `router` (0-based: 0 is node 0) dies: its clients' streams
    /// break off, the engines drop its requests when it has been silent
    /// past the down bound, its clients go to the other Routers.
    RouterCrash {
        /// Which Router.
        router: usize,
    },
    /// A crashed Router starts again (a new life), with no requests and
    /// no view: the engines' heartbeats and prefix reports rebuild it.
    RouterRestart {
        /// Which Router.
        router: usize,
    },
    /// Engine node `node`, one of `[topology] joiners`, joins the running
    /// cluster (it starts; the Routers hear of it from its connection and
    /// place on it from its first heartbeat). Again after it left or
    /// crashed: a new life.
    Join {
        /// Node id (a joiner).
        node: u32,
    },
    /// Hold every message on `a -> b` until `unclog`.
    Clog {
        /// Sender.
        a: u32,
        /// Receiver.
        b: u32,
    },
    /// Release every clogged link, one at a time in a random order.
    Unclog,
}

/// A scenario that cannot run.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    /// Not readable.
    #[error("reading {path}: {err}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        err: std::io::Error,
    },
    /// Not valid TOML for a scenario.
    #[error("{path}: {err}")]
    Parse {
        /// The file.
        path: String,
        /// Where and why.
        err: String,
    },
    /// A value out of range or a dangling name.
    #[error("{0}")]
    Invalid(String),
}

impl Scenario {
    /// Engine nodes of every role.
    pub fn engine_nodes(&self) -> usize {
        self.topology.engines + self.topology.prefill + self.topology.decode
    }

    /// The cluster settings the simulated nodes run with (`[cluster]`).
    pub fn cluster_config(&self) -> flotilla_config::ClusterSection {
        self.cluster.clone()
    }

    /// Router `i`'s node id: the first is node 0, the others come after
    /// the engine nodes.
    pub fn router_node(&self, i: usize) -> u32 {
        if i == 0 {
            0
        } else {
            (self.engine_nodes() + i) as u32
        }
    }

    /// Every Router's node id, the first first.
    pub fn router_nodes(&self) -> Vec<u32> {
        (0..self.topology.routers.max(1))
            .map(|i| self.router_node(i))
            .collect()
    }

    /// The heartbeat period.
    pub fn heartbeat(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.cluster.heartbeat_interval_ms)
    }

    /// Whether engine node `node` joins at run time (is in no config).
    pub fn is_joiner(&self, node: u32) -> bool {
        let n = node as usize;
        n <= self.topology.engines && n + self.topology.joiners > self.topology.engines
    }

    /// The engine nodes that join at run time.
    pub fn joiner_nodes(&self) -> Vec<u32> {
        (1..=self.engine_nodes() as u32)
            .filter(|&n| self.is_joiner(n))
            .collect()
    }

    /// The role of engine node `node` (1-based).
    pub fn role_of(&self, node: u32) -> flotilla_proto::Role {
        let n = node as usize;
        let c = &self.topology;
        if n <= c.engines {
            flotilla_proto::Role::Worker
        } else if n <= c.engines + c.prefill {
            flotilla_proto::Role::Prefill
        } else {
            flotilla_proto::Role::Decode
        }
    }

    /// The tier of tenant `tenant` (an index into the config's tiers).
    pub fn tier_of(&self, tenant: usize) -> usize {
        self.config.tenants.get(tenant).map_or(0, |t| t.tier)
    }

    /// Why fast mode cannot run this scenario, if it cannot: faults drawn
    /// per message (loss, duplication, reordering) fire at any step, so
    /// no span is free of them.
    pub fn fast_refusal(&self) -> Option<String> {
        let n = &self.network;
        let per_message = [
            ("network.loss", n.loss),
            ("network.duplicate", n.duplicate),
            ("network.reorder", n.reorder),
        ];
        let set: Vec<&str> = per_message
            .iter()
            .filter(|(_, x)| *x > 0.0)
            .map(|(k, _)| *k)
            .collect();
        (!set.is_empty()).then(|| {
            format!(
                "fast mode cannot honour this scenario: {} draw a fault for every message, \
                 at any step, so no span of the run could skip steps and stay equal to the \
                 exact mode; run it without --fast",
                set.join(", ")
            )
        })
    }

    /// The spans of simulated time (from the start of arrivals) that fast
    /// mode runs step by step, given the run's faults (scheduled and
    /// drawn): from `EXACT_LEAD` plus the longest decode step before each
    /// fault to the recovery after it (twice the down bound, four
    /// heartbeats and a drain's grace), a cut link's span lasting until the
    /// heal or unclog that ends it. Sorted, merged.
    pub fn exact_spans(&self, faults: &[FaultSection]) -> Result<Vec<(f64, f64)>, ScenarioError> {
        let lead = (EXACT_LEAD + self.longest_decode_step()?).as_secs_f64();
        let hb = self.heartbeat().as_secs_f64();
        let tail = 2.0 * hb * self.cluster.down_after_missed as f64 + 4.0 * hb;
        let mut sorted: Vec<&FaultSection> = faults.iter().collect();
        sorted.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
        let mut spans: Vec<(f64, f64)> = Vec::new();
        // A partition or clog holds its span open until what ends it.
        let mut open_cut: Option<f64> = None;
        for f in sorted {
            let t = f.at_s;
            let grace = match f.kind {
                FaultKind::Drain { grace_ms, .. } => grace_ms as f64 / 1e3,
                _ => 0.0,
            };
            match f.kind {
                FaultKind::Partition { .. } | FaultKind::Clog { .. } => {
                    open_cut.get_or_insert(t);
                    continue;
                }
                FaultKind::Heal | FaultKind::Unclog => {
                    let from = open_cut.take().unwrap_or(t);
                    spans.push((from - lead, t + tail));
                    continue;
                }
                _ => {}
            }
            spans.push((t - lead, t + grace + tail));
        }
        if let Some(from) = open_cut {
            spans.push((from - lead, f64::INFINITY));
        }
        spans.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut merged: Vec<(f64, f64)> = Vec::new();
        for (a, b) in spans {
            match merged.last_mut() {
                Some(last) if a <= last.1 => last.1 = last.1.max(b),
                _ => merged.push((a.max(0.0), b)),
            }
        }
        Ok(merged)
    }

    /// The longest decode step the cost model gives an engine: every seat
    /// taken, every sequence at the longest context.
    fn longest_decode_step(&self) -> Result<std::time::Duration, ScenarioError> {
        let (g, m) = (self.gpu_params()?, self.model_shape()?);
        let seqs: Vec<crate::cost::SeqCost> = (0..self.engine.max_num_seqs)
            .map(|_| crate::cost::SeqCost {
                start_pos: self.max_model_len.saturating_sub(1),
                tokens: 1,
            })
            .collect();
        Ok(crate::cost::step_time_masked(&g, &m, &seqs, 0))
    }

    /// Reads and validates a scenario file.
    pub fn load(path: &Path) -> Result<Scenario, ScenarioError> {
        let text = std::fs::read_to_string(path).map_err(|err| ScenarioError::Read {
            path: path.display().to_string(),
            err,
        })?;
        let dir = path.parent().unwrap_or(Path::new("."));
        Scenario::parse_named(&text, &path.display().to_string(), dir)
    }

    /// Parses and validates scenario text (trace files relative to the
    /// working directory).
    pub fn parse(text: &str) -> Result<Scenario, ScenarioError> {
        Scenario::parse_named(text, "scenario", Path::new("."))
    }

    /// Every traffic's arrivals replaced by `file`'s lines of its tenant
    /// (a tenant without lines sends nothing), at the trace's own speed.
    pub fn replay(&mut self, file: &Path) -> Result<(), ScenarioError> {
        let rows = read_trace(file)?;
        for t in &mut self.traffic {
            t.arrivals = Arrivals::Trace {
                file: file.display().to_string(),
                speed: 1.0,
                rows: Arc::default(),
                period_s: 0.0,
            };
        }
        self.fill_traces(&rows)?;
        self.validate()
    }

    /// Each trace traffic's rows and the loop period, from the whole
    /// trace's `rows`.
    fn fill_traces(&mut self, all: &[TraceRow]) -> Result<(), ScenarioError> {
        let (first, last) = match (all.first(), all.last()) {
            (Some(a), Some(b)) if b.t > a.t => (a.t, b.t),
            _ => {
                return Err(ScenarioError::Invalid(
                    "a trace's requests all arrive at one instant: it has no rate".into(),
                ));
            }
        };
        // One loop: to the last request and one mean gap beyond, so the
        // next loop's first request does not land on the last one.
        let period_s = last + (last - first) / (all.len() - 1) as f64;
        let names: Vec<String> = self.config.tenants.iter().map(|t| t.name.clone()).collect();
        if let Some(r) = all.iter().find(|r| !names.contains(&r.tenant)) {
            return Err(ScenarioError::Invalid(format!(
                "the trace names tenant '{}', which the scenario does not have",
                r.tenant
            )));
        }
        for t in &mut self.traffic {
            if let Arrivals::Trace {
                rows, period_s: p, ..
            } = &mut t.arrivals
            {
                *rows = Arc::new(
                    all.iter()
                        .filter(|r| r.tenant == t.tenant)
                        .cloned()
                        .collect(),
                );
                *p = period_s;
            }
        }
        Ok(())
    }

    /// Parses and validates scenario text; `origin` names it in errors,
    /// trace files are relative to `dir`.
    fn parse_named(text: &str, origin: &str, dir: &Path) -> Result<Scenario, ScenarioError> {
        let raw: RawScenario = toml::from_str(text).map_err(|e| ScenarioError::Parse {
            path: origin.into(),
            err: e.to_string(),
        })?;
        // The config's tables, as `flotilla serve` and `flotilla node` read
        // them from a config file.
        // (Its errors name the origin and line themselves.)
        let config = flotilla_config::ClusterConfig::parse_embedded(text, origin, &OWN_TABLES)
            .map_err(|e| ScenarioError::Invalid(e.to_string()))?;
        let bad = |m: String| ScenarioError::Invalid(m);
        let engine = config
            .engine
            .resolve(
                &flotilla_config::EngineSection::default(),
                &raw.flags.batching,
                &sim_engine_defaults(),
            )
            .map_err(bad)?;
        let max_model_len = config.engine.max_model_len.unwrap_or(MAX_MODEL_LEN_DEFAULT);
        let cluster = config
            .cluster
            .clone()
            .unwrap_or_else(flotilla_config::ClusterSection::defaults);
        let mut network = raw.network;
        network.frame_len_max_bytes = cluster.frame_len_max_bytes;
        network.idle_timeout_ms = cluster.idle_timeout_ms;
        // The objectives and the traffic in the config's tier and tenant
        // order, one each.
        let tiers: Vec<&str> = config.tiers.iter().map(|t| t.name.as_str()).collect();
        let slos = one_each(&raw.slos, &tiers, |s| &s.tier, ("tier", "[[slos]]"))?;
        let tenants: Vec<&str> = config.tenants.iter().map(|t| t.name.as_str()).collect();
        let traffic = one_each(
            &raw.traffic,
            &tenants,
            |x| &x.tenant,
            ("tenant", "[[traffic]]"),
        )?;
        let sc = Scenario {
            run: raw.run,
            model: raw.model,
            gpu: raw.gpu,
            config,
            engine,
            max_model_len,
            cluster,
            topology: raw.topology,
            network,
            slos,
            traffic,
            faults: raw.faults,
            chaos: raw.chaos,
            pipeline: raw.pipeline,
            sim: raw.sim,
        };
        let mut sc = sc;
        // Trace files, each read once (every tenant's lines in it).
        let files: std::collections::BTreeSet<String> = sc
            .traffic
            .iter()
            .filter_map(|t| match &t.arrivals {
                Arrivals::Trace { file, .. } => Some(file.clone()),
                _ => None,
            })
            .collect();
        if files.len() > 1 {
            return Err(ScenarioError::Invalid(
                "every traced tenant must replay the same trace file".into(),
            ));
        }
        if let Some(f) = files.first() {
            let rows = read_trace(&dir.join(f))?;
            sc.fill_traces(&rows)?;
        }
        sc.validate()?;
        Ok(sc)
    }

    /// The accelerator's figures.
    pub fn gpu_params(&self) -> Result<GpuParams, ScenarioError> {
        match &self.gpu {
            Named::Preset { preset, set } => {
                let base = GpuParams::preset(preset).ok_or_else(|| {
                    ScenarioError::Invalid(format!(
                        "unknown gpu preset '{preset}' (h100, h200, a100, cpu)"
                    ))
                })?;
                with_fields(base, set, "gpu")
            }
            Named::Gpu(g) => Ok(g.clone()),
            Named::Model(_) => Err(ScenarioError::Invalid("[gpu] holds model fields".into())),
        }
    }

    /// Stages of each engine node's group (1: no groups).
    pub fn stages(&self) -> usize {
        self.pipeline.as_ref().map_or(1, |p| p.stages)
    }

    /// The pipeline groups' model, where `[pipeline]` makes groups.
    pub fn pipe_model(&self) -> Result<Option<crate::exec::PipeModel>, ScenarioError> {
        let Some(p) = &self.pipeline else {
            return Ok(None);
        };
        let width = match p.activations.as_str() {
            "f16" => 2,
            "f32" => 4,
            other => {
                return Err(ScenarioError::Invalid(format!(
                    "pipeline.activations '{other}': f16 or f32"
                )));
            }
        };
        Ok(Some(crate::exec::PipeModel {
            stages: p.stages,
            hop_latency: std::time::Duration::from_secs_f64(p.hop_latency_us * 1e-6),
            link_bytes_per_s: p.link_gbps * 1e9 / 8.0,
            row_bytes: self.model_shape()?.q_width * width,
        }))
    }

    /// The draft model's shape, where `[engine]` speculates with one
    /// (`draft_model`: a model preset sharing the model's vocabulary).
    pub fn draft_shape(&self) -> Result<Option<ModelShape>, ScenarioError> {
        if !self.engine.speculation.draft_model {
            return Ok(None);
        }
        let name = self.engine.draft_model.as_deref().unwrap_or_default();
        let mut d = ModelShape::preset(name).ok_or_else(|| {
            ScenarioError::Invalid(format!(
                "engine.draft_model: unknown model preset '{name}' ({})",
                ModelShape::PRESETS.join(", ")
            ))
        })?;
        let target = self.model_shape()?;
        if d.vocab != target.vocab {
            return Err(ScenarioError::Invalid(format!(
                "engine.draft_model: {name}'s vocabulary ({} tokens) differs from {}'s ({} tokens)",
                d.vocab, target.name, target.vocab
            )));
        }
        if self.pipeline.is_some() {
            return Err(ScenarioError::Invalid(
                "engine.draft_model: a draft model runs beside a whole model, not in a pipeline group".into(),
            ));
        }
        d.kv_dtype = target.kv_dtype;
        Ok(Some(d))
    }

    /// The model's shape.
    pub fn model_shape(&self) -> Result<ModelShape, ScenarioError> {
        let mut m = match &self.model {
            Named::Preset { preset, set } => {
                let base = ModelShape::preset(preset).ok_or_else(|| {
                    ScenarioError::Invalid(format!(
                        "unknown model preset '{preset}' ({})",
                        ModelShape::PRESETS.join(", ")
                    ))
                })?;
                with_fields(base, set, "model")?
            }
            Named::Model(m) => m.clone(),
            Named::Gpu(_) => return Err(ScenarioError::Invalid("[model] holds gpu fields".into())),
        };
        let bad = |why: String| ScenarioError::Invalid(format!("engine.kv_cache_dtype: {why}"));
        m.kv_dtype = self.engine.kv_dtype;
        m.kv_dtype.check_head_dim(m.head_dim).map_err(bad)?;
        Ok(m)
    }

    /// Checks ranges, names and faults; the error says what is wrong.
    pub fn validate(&self) -> Result<(), ScenarioError> {
        let bad = |m: String| Err(ScenarioError::Invalid(m));
        let g = self.gpu_params()?;
        let m = self.model_shape()?;
        self.draft_shape()?;
        // Every figure a time is divided by or built from: a zero, a
        // negative or a NaN would panic deep in the run instead.
        let positive = |x: f64| x.is_finite() && x > 0.0;
        for (what, x) in [
            ("gpu.prefill_flops", g.prefill_flops),
            ("gpu.decode_flops", g.decode_flops),
            (
                "gpu.attn_prefill_flops",
                g.attn_prefill_flops.unwrap_or(g.prefill_flops),
            ),
            (
                "gpu.attn_decode_flops",
                g.attn_decode_flops.unwrap_or(g.decode_flops),
            ),
            ("gpu.mem_bw", g.mem_bw),
            ("gpu.mem_bytes", g.mem_bytes),
            ("model.params", m.params),
            ("model.weight_bytes_per_param", m.weight_bytes_per_param),
            ("network.bandwidth", self.network.bandwidth),
        ] {
            if !positive(x) {
                return bad(format!("{what} {x} must be a positive number"));
            }
        }
        if !(g.overhead_s.is_finite() && (0.0..=1.0).contains(&g.overhead_s)) {
            return bad(format!("gpu.overhead_s {} is not in [0, 1]", g.overhead_s));
        }
        for (what, x) in [
            ("model.n_layer", m.n_layer),
            ("model.q_width", m.q_width),
            ("model.n_head_kv", m.n_head_kv),
            ("model.head_dim", m.head_dim),
            ("model.ctx_len", m.ctx_len),
            ("engine.max_num_seqs", self.engine.max_num_seqs),
            (
                "engine.max_num_batched_tokens",
                self.engine.max_num_batched_tokens,
            ),
            ("engine.max_model_len", self.max_model_len),
        ] {
            if x == 0 {
                return bad(format!("{what} must be at least 1"));
            }
        }
        if m.vocab < 4 {
            return bad(format!("model.vocab {} must be at least 4", m.vocab));
        }
        if !(self.run.duration_s > 0.0 && self.run.duration_s <= 86_400.0) {
            return bad(format!(
                "run.duration_s {} is not in (0, 86400]",
                self.run.duration_s
            ));
        }
        if !(self.run.drain_s >= 0.0 && self.run.drain_s <= 86_400.0) {
            return bad(format!(
                "run.drain_s {} is not in [0, 86400]",
                self.run.drain_s
            ));
        }
        let c = &self.topology;
        let total = c.engines + c.prefill + c.decode;
        if total == 0 || total > 4096 {
            return bad(format!("{total} engine nodes: the cluster needs 1..=4096"));
        }
        if !(1..=8).contains(&c.routers) {
            return bad(format!(
                "topology.routers = {}: the cluster needs 1..=8",
                c.routers
            ));
        }
        if c.prefill > 0 && c.decode == 0 {
            return bad("topology.prefill nodes need at least one decode node".into());
        }
        if c.joiners > 0 && c.joiners >= c.engines {
            return bad(format!(
                "topology.joiners = {} of {} engines: at least one mixed engine is in the \
                 config, so the cluster serves before anyone joins",
                c.joiners, c.engines
            ));
        }
        if self.max_model_len > m.ctx_len {
            return bad(format!(
                "engine.max_model_len {} exceeds the model's context {}",
                self.max_model_len, m.ctx_len
            ));
        }
        for p in [
            ("network.loss", self.network.loss),
            ("network.duplicate", self.network.duplicate),
            ("network.reorder", self.network.reorder),
        ] {
            if !(0.0..=1.0).contains(&p.1) {
                return bad(format!("{} {} is not in [0, 1]", p.0, p.1));
            }
        }
        for t in &self.traffic {
            if !(0.0..=1.0).contains(&t.cancel_fraction) {
                return bad(format!(
                    "tenant '{}': cancel_fraction not in [0, 1]",
                    t.tenant
                ));
            }
            if !(0.0..1.0).contains(&t.draft_acceptance) {
                return bad(format!(
                    "tenant '{}': draft_acceptance not in [0, 1)",
                    t.tenant
                ));
            }
            if !(0.0..=1.0).contains(&t.constrained_fraction) {
                return bad(format!(
                    "tenant '{}': constrained_fraction not in [0, 1]",
                    t.tenant
                ));
            }
            let positive = match t.arrivals {
                Arrivals::Poisson { rate_per_s } => rate_per_s > 0.0,
                Arrivals::Closed { clients, requests } => clients > 0 && requests != Some(0),
                Arrivals::Bursts {
                    rate_per_s,
                    burst,
                    every_s,
                } => rate_per_s >= 0.0 && burst > 0 && every_s > 0.0,
                Arrivals::Trace {
                    speed, period_s, ..
                } => speed.is_finite() && speed > 0.0 && period_s > 0.0,
            };
            if !positive {
                return bad(format!("tenant '{}': arrivals must be positive", t.tenant));
            }
            if let Arrivals::Trace { rows, .. } = &t.arrivals {
                if let Some(r) = rows
                    .iter()
                    .find(|r| r.prompt_tokens.saturating_add(1) > self.max_model_len as u32)
                {
                    return bad(format!(
                        "tenant '{}': a trace request of {} prompt tokens leaves no room in \
                         max_model_len {}",
                        t.tenant, r.prompt_tokens, self.max_model_len
                    ));
                }
                continue;
            }
            for (what, l) in [("prompt", &t.prompt), ("output", &t.output)] {
                let (lo, hi) = match *l {
                    Lengths::Fixed { tokens } => (tokens, tokens),
                    Lengths::Lognormal { min, max, .. } | Lengths::Uniform { min, max } => {
                        (min, max)
                    }
                };
                if lo == 0 || lo > hi {
                    return bad(format!(
                        "tenant '{}': {what} lengths need 1 <= min <= max",
                        t.tenant
                    ));
                }
            }
        }
        if let Some(p) = &self.pipeline {
            if !(2..=m.n_layer).contains(&p.stages) {
                return bad(format!(
                    "pipeline.stages {} is not in 2..={} (the model's layers)",
                    p.stages, m.n_layer
                ));
            }
            if !(p.hop_latency_us.is_finite() && (0.0..=1e6).contains(&p.hop_latency_us)) {
                return bad(format!(
                    "pipeline.hop_latency_us {} is not in [0, 1e6]",
                    p.hop_latency_us
                ));
            }
            if !positive(p.link_gbps) {
                return bad(format!(
                    "pipeline.link_gbps {} must be a positive number",
                    p.link_gbps
                ));
            }
            self.pipe_model()?;
        }
        let engines = total as u32;
        if let Some(c) = &self.chaos {
            c.validate(self.run.duration_s)
                .map_err(ScenarioError::Invalid)?;
            if c.router_crashes > 0 && self.topology.routers < 2 {
                return bad(format!(
                    "[chaos] router_crashes = {}: needs `[topology] routers` of 2 or more \
                     (one is never crashed while it is the last one up)",
                    c.router_crashes
                ));
            }
            if c.joins > 0 && self.topology.joiners == 0 {
                return bad(format!(
                    "[chaos] joins = {}: needs `[topology] joiners`",
                    c.joins
                ));
            }
            if c.stage_crashes > 0 && self.pipeline.is_none() {
                return bad(format!(
                    "[chaos] stage_crashes = {}: the scenario has no [pipeline] groups",
                    c.stage_crashes
                ));
            }
        }
        let routers = self.topology.routers;
        for f in &self.faults {
            let node_ok = |n: u32| (1..=engines).contains(&n);
            let ok = match f.kind {
                FaultKind::RouterCrash { router } | FaultKind::RouterRestart { router } => {
                    if router >= routers {
                        return bad(format!(
                            "fault {:?} at {} s: router {router} is not in 0..{routers} \
                             (`[topology] routers`)",
                            f.kind, f.at_s
                        ));
                    }
                    true
                }
                FaultKind::Crash { node }
                | FaultKind::Restart { node }
                | FaultKind::Drain { node, .. } => node_ok(node),
                FaultKind::Join { node } => {
                    if !self.is_joiner(node) {
                        return bad(format!(
                            "fault {:?} at {} s: node {node} is not one of the joiners {:?} \
                             (`[topology] joiners`)",
                            f.kind,
                            f.at_s,
                            self.joiner_nodes()
                        ));
                    }
                    true
                }
                FaultKind::Partition { a, b, .. } | FaultKind::Clog { a, b } => {
                    let last = engines + routers as u32 - 1;
                    a <= last && b <= last && a != b
                }
                FaultKind::Heal | FaultKind::Unclog => true,
                FaultKind::StageCrash { node, stage } | FaultKind::StageRestart { node, stage } => {
                    if !(1..self.stages()).contains(&stage) {
                        return bad(format!(
                            "fault {:?} at {} s: stage {stage} is not in 1..{} \
                             (`[pipeline] stages`; stage 0 is the node: `crash`)",
                            f.kind,
                            f.at_s,
                            self.stages()
                        ));
                    }
                    node_ok(node)
                }
            };
            if !(ok && f.at_s.is_finite() && f.at_s >= 0.0) {
                return bad(format!(
                    "fault {:?} at {} s names a node outside 0..={} (engines 1..={engines}, \
                     Routers 0 and past the engines)",
                    f.kind,
                    f.at_s,
                    engines + routers as u32 - 1
                ));
            }
        }
        Ok(())
    }
}
