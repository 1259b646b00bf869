//! Scenario files (`simulations/*.toml`): the cluster, the hardware, the
//! workload and the faults of one simulation.

use std::path::Path;

use serde::Deserialize;

use crate::cost::{GpuParams, ModelShape};
use flotilla_transport::sim::LinkConfig;

/// One scenario.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Length of the run.
    pub run: RunSection,
    /// The model (a preset name or every field).
    pub model: Named,
    /// The accelerator of every engine node (a preset name or every field).
    pub gpu: Named,
    /// Engine limits, as `flotilla serve` takes them.
    #[serde(default)]
    pub engine: EngineSection,
    /// Nodes and membership timing.
    #[serde(default)]
    pub cluster: ClusterSection,
    /// Link figures and per-message fault rates.
    #[serde(default)]
    pub network: LinkConfig,
    /// Service tiers.
    pub tiers: Vec<TierSection>,
    /// Tenants and their traffic.
    pub tenants: Vec<TenantSection>,
    /// Scheduled faults.
    #[serde(default)]
    pub faults: Vec<FaultSection>,
    /// Faults drawn by the seed, beside the scheduled ones.
    #[serde(default)]
    pub chaos: Option<crate::chaos::ChaosSection>,
}

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

/// Engine limits.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineSection {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Most sequences in a batch.
    pub max_num_seqs: usize,
    /// Most tokens in a step.
    pub max_num_batched_tokens: usize,
    /// Longest prompt + output.
    pub max_model_len: usize,
    /// `continuous` or `static`.
    pub batching: String,
    /// Longest wait in a queue before a request fails, seconds.
    pub queue_timeout_s: f64,
    /// KV cache element type (`f16`, `int8`, `f32`): the block count per
    /// GPU, the bytes a transfer moves and attention reads follow from it.
    pub kv_cache_dtype: String,
    /// `ngram` or `off` (the default: the simulator's tokens are random,
    /// so a draft almost never matches; on, it charges the verify
    /// positions of whatever drafts the lookup finds).
    pub speculative: String,
    /// Bytes of host memory per engine for the KV offload tier (0: none):
    /// evicted prefix blocks spill there and come back on a hit, each move
    /// charged at `[gpu] host_link_bw`.
    pub kv_offload_bytes: u64,
    /// Longest a step carrying prefill chunks should take, milliseconds,
    /// by the simulated steps' measured cost (`[engine] step_time_max_ms`
    /// of a server); none by default.
    pub step_time_max_ms: Option<f64>,
    /// Most decode steps one plan may run back to back when the batch is
    /// all decodes and nothing waits (`[engine] decode_steps` of a server;
    /// 1, the default: one step per plan). Each plan's tokens reach the
    /// clients when it ends, so the simulator advances many tokens per
    /// event; a plan is cut after the step in progress when its engine is
    /// told anything (a request, a cancel, KV), so arrivals wait no longer
    /// than with single steps. TTFT and each request's mean TPOT are the
    /// same; the gaps between a stream's tokens grow.
    pub decode_steps: usize,
}

impl Default for EngineSection {
    fn default() -> Self {
        EngineSection {
            block_size: 16,
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            max_model_len: 4096,
            batching: "continuous".into(),
            queue_timeout_s: 60.0,
            kv_cache_dtype: "f16".into(),
            speculative: "off".into(),
            kv_offload_bytes: 0,
            step_time_max_ms: None,
            decode_steps: 1,
        }
    }
}

/// The engine nodes and membership timing. Node 0 is the Router; then the
/// mixed engines, then the prefill nodes, then the decode nodes.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterSection {
    /// Mixed engine nodes (whole requests).
    pub engines: usize,
    /// Prefill nodes (disaggregated serving; needs decode nodes).
    pub prefill: usize,
    /// Decode nodes.
    pub decode: usize,
    /// Transfers a prefill node sends at once.
    pub kv_transfers_max: usize,
    /// Heartbeat period, ms.
    pub heartbeat_ms: u64,
    /// Missed heartbeats before a node is down.
    pub down_after_missed: u32,
}

impl Default for ClusterSection {
    /// One engine; timing and limits as a cluster config's defaults.
    fn default() -> Self {
        let d = flotilla_config::ClusterSection::defaults();
        ClusterSection {
            engines: 1,
            prefill: 0,
            decode: 0,
            kv_transfers_max: d.kv_transfers_max,
            heartbeat_ms: d.heartbeat_interval_ms,
            down_after_missed: d.down_after_missed,
        }
    }
}

/// A tier and its latency objective.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TierSection {
    /// Name.
    pub name: String,
    /// Fair-share weight.
    #[serde(default = "one")]
    pub weight: u32,
    /// Higher is more protected.
    #[serde(default)]
    pub priority: u8,
    /// Queue cap.
    #[serde(default = "queue_len")]
    pub queue_len_max: usize,
    /// A request meets the SLO if its TTFT is at most this...
    pub slo_ttft_ms: f64,
    /// ...and its mean TPOT at most this.
    pub slo_tpot_ms: f64,
    /// Latency budget in tokens per step (the engine's `[[tiers]]
    /// step_tokens_max`).
    #[serde(default)]
    pub step_tokens_max: Option<usize>,
    /// The same budget as a step time in milliseconds (`[[tiers]]
    /// step_time_max_ms`), sized by the simulated steps' measured cost.
    #[serde(default)]
    pub step_time_max_ms: Option<f64>,
    /// KV blocks no lower tier may take (`[[tiers]] kv_reserved_blocks`).
    #[serde(default)]
    pub kv_reserved_blocks: u32,
}

fn one() -> u32 {
    1
}

fn queue_len() -> usize {
    1024
}

/// A tenant and its traffic.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantSection {
    /// Name.
    pub name: String,
    /// Its tier's name.
    pub tier: String,
    /// Most requests in flight (0 = no limit).
    #[serde(default)]
    pub max_concurrent: u32,
    /// Fair-share weight within its tier (`[[tenants]] weight`).
    #[serde(default = "one")]
    pub weight: u32,
    /// Most requests admitted per minute (`[[tenants]]
    /// requests_per_minute`; none by default).
    #[serde(default)]
    pub requests_per_minute: Option<u32>,
    /// Most KV blocks its requests may hold (`[[tenants]] kv_blocks_max`).
    #[serde(default)]
    pub kv_blocks_max: Option<u32>,
    /// Its prefixes are cached apart from other tenants'
    /// (`[[tenants]] isolate_prefix_cache`).
    #[serde(default)]
    pub isolate_prefix_cache: bool,
    /// How requests arrive.
    pub arrivals: Arrivals,
    /// Prompt lengths, tokens.
    pub prompt: Lengths,
    /// Output lengths, tokens.
    pub output: Lengths,
    /// Fraction of requests whose client leaves mid-stream.
    #[serde(default)]
    pub cancel_fraction: f64,
    /// Fraction of requests under an output constraint (structured
    /// outputs, required tool calls): each of their samples needs a token
    /// mask, which costs the accelerator's `mask_us`.
    #[serde(default)]
    pub constrained_fraction: f64,
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
        self.cluster.engines + self.cluster.prefill + self.cluster.decode
    }

    /// The cluster settings the simulated nodes run with: a cluster
    /// config's defaults, with the scenario's timing and limits.
    pub fn cluster_config(&self) -> flotilla_config::ClusterSection {
        flotilla_config::ClusterSection {
            heartbeat_interval_ms: self.cluster.heartbeat_ms,
            down_after_missed: self.cluster.down_after_missed,
            kv_transfers_max: self.cluster.kv_transfers_max,
            frame_len_max_bytes: self.network.frame_len_max_bytes,
            idle_timeout_ms: self.network.idle_timeout_ms,
            ..flotilla_config::ClusterSection::defaults()
        }
    }

    /// The engine's side of the scenario as a cluster config (its
    /// `[engine]` numbers, tiers and tenants, no keys), checked as a
    /// file's is: the Scheduler's config is built from it by the same
    /// code as `flotilla serve`'s ([`flotilla_config::ClusterConfig::sched_config`]).
    pub fn engine_config(&self) -> Result<flotilla_config::ClusterConfig, ScenarioError> {
        use flotilla_config::{ClusterConfig, EngineSection, Tenant, Tier};
        let e = &self.engine;
        let engine = EngineSection {
            max_model_len: Some(e.max_model_len),
            max_num_seqs: Some(e.max_num_seqs),
            max_num_batched_tokens: Some(e.max_num_batched_tokens),
            block_size: Some(e.block_size),
            queue_timeout_s: Some(e.queue_timeout_s),
            kv_cache_dtype: Some(e.kv_cache_dtype.clone()),
            speculative: Some(e.speculative.clone()),
            kv_offload_bytes: Some(e.kv_offload_bytes),
            step_time_max_ms: e.step_time_max_ms,
            decode_steps: Some(e.decode_steps),
            ..EngineSection::default()
        };
        let tiers = self
            .tiers
            .iter()
            .map(|t| Tier {
                name: t.name.clone(),
                weight: t.weight,
                priority: t.priority,
                queue_len_max: t.queue_len_max,
                kv_reserved_blocks: t.kv_reserved_blocks,
                step_tokens_max: t.step_tokens_max,
                step_time_max_ms: t.step_time_max_ms,
            })
            .collect();
        let mut tenants = Vec::new();
        for t in &self.tenants {
            let Some(tier) = self.tiers.iter().position(|x| x.name == t.tier) else {
                return Err(ScenarioError::Invalid(format!(
                    "tenant '{}': unknown tier '{}'",
                    t.name, t.tier
                )));
            };
            tenants.push(Tenant {
                name: t.name.clone(),
                tier,
                api_keys: Vec::new(),
                weight: t.weight,
                max_concurrent: t.max_concurrent,
                requests_per_minute: t.requests_per_minute,
                kv_blocks_max: t.kv_blocks_max,
                isolate_prefix_cache: t.isolate_prefix_cache,
            });
        }
        ClusterConfig::from_parts(engine, tiers, tenants).map_err(ScenarioError::Invalid)
    }

    /// The role of engine node `node` (1-based).
    pub fn role_of(&self, node: u32) -> flotilla_proto::Role {
        let n = node as usize;
        let c = &self.cluster;
        if n <= c.engines {
            flotilla_proto::Role::Worker
        } else if n <= c.engines + c.prefill {
            flotilla_proto::Role::Prefill
        } else {
            flotilla_proto::Role::Decode
        }
    }

    /// Reads and validates a scenario file.
    pub fn load(path: &Path) -> Result<Scenario, ScenarioError> {
        let text = std::fs::read_to_string(path).map_err(|err| ScenarioError::Read {
            path: path.display().to_string(),
            err,
        })?;
        Scenario::parse(&text).map_err(|e| match e {
            ScenarioError::Parse { err, .. } => ScenarioError::Parse {
                path: path.display().to_string(),
                err,
            },
            other => other,
        })
    }

    /// Parses and validates scenario text.
    pub fn parse(text: &str) -> Result<Scenario, ScenarioError> {
        let s: Scenario = toml::from_str(text).map_err(|e| ScenarioError::Parse {
            path: "scenario".into(),
            err: e.to_string(),
        })?;
        s.validate()?;
        Ok(s)
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

    /// The model's shape.
    pub fn model_shape(&self) -> Result<ModelShape, ScenarioError> {
        let mut m = match &self.model {
            Named::Preset { preset, set } => {
                let base = ModelShape::preset(preset).ok_or_else(|| {
                    ScenarioError::Invalid(format!(
                        "unknown model preset '{preset}' (llama-7b, llama3-8b, smollm2-135m, gemma3-270m)"
                    ))
                })?;
                with_fields(base, set, "model")?
            }
            Named::Model(m) => m.clone(),
            Named::Gpu(_) => return Err(ScenarioError::Invalid("[model] holds gpu fields".into())),
        };
        let bad = |why: String| ScenarioError::Invalid(format!("engine.kv_cache_dtype: {why}"));
        m.kv_dtype = flotilla_exec::KvDtype::parse(&self.engine.kv_cache_dtype).map_err(bad)?;
        m.kv_dtype.check_head_dim(m.head_dim).map_err(bad)?;
        Ok(m)
    }

    fn validate(&self) -> Result<(), ScenarioError> {
        let bad = |m: String| Err(ScenarioError::Invalid(m));
        let g = self.gpu_params()?;
        let m = self.model_shape()?;
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
            ("engine.max_model_len", self.engine.max_model_len),
        ] {
            if x == 0 {
                return bad(format!("{what} must be at least 1"));
            }
        }
        if m.vocab < 4 {
            return bad(format!("model.vocab {} must be at least 4", m.vocab));
        }
        if !(1..=1024).contains(&self.engine.block_size) {
            return bad(format!(
                "engine.block_size {} is not in 1..=1024",
                self.engine.block_size
            ));
        }
        let q = self.engine.queue_timeout_s;
        if !(q.is_finite() && q > 0.0 && q <= 86_400.0) {
            return bad(format!("engine.queue_timeout_s {q} is not in (0, 86400]"));
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
        let c = &self.cluster;
        let total = c.engines + c.prefill + c.decode;
        if total == 0 || total > 4096 {
            return bad(format!("{total} engine nodes: the cluster needs 1..=4096"));
        }
        if c.prefill > 0 && c.decode == 0 {
            return bad("cluster.prefill nodes need at least one decode node".into());
        }
        if let Err(why) = self.cluster_config().check() {
            return bad(format!(
                "{why} (a scenario sets these as cluster.heartbeat_ms, cluster.down_after_missed, \
                 cluster.kv_transfers_max, network.frame_len_max_bytes and network.idle_timeout_ms)"
            ));
        }
        if self.engine.max_model_len > m.ctx_len {
            return bad(format!(
                "engine.max_model_len {} exceeds the model's context {}",
                self.engine.max_model_len, m.ctx_len
            ));
        }
        if !["continuous", "static"].contains(&self.engine.batching.as_str()) {
            return bad(format!(
                "engine.batching '{}' (expected continuous or static)",
                self.engine.batching
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
        if self.tiers.is_empty() || self.tenants.is_empty() {
            return bad("a scenario needs at least one tier and one tenant".into());
        }
        for t in &self.tenants {
            if !self.tiers.iter().any(|x| x.name == t.tier) {
                return bad(format!(
                    "tenant '{}' names unknown tier '{}'",
                    t.name, t.tier
                ));
            }
            if !(0.0..=1.0).contains(&t.cancel_fraction) {
                return bad(format!(
                    "tenant '{}': cancel_fraction not in [0, 1]",
                    t.name
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
            };
            if !positive {
                return bad(format!("tenant '{}': arrivals must be positive", t.name));
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
                        t.name
                    ));
                }
            }
        }
        let engines = total as u32;
        if let Some(c) = &self.chaos {
            c.validate(self.run.duration_s)
                .map_err(ScenarioError::Invalid)?;
        }
        for f in &self.faults {
            let node_ok = |n: u32| (1..=engines).contains(&n);
            let ok = match f.kind {
                FaultKind::Crash { node }
                | FaultKind::Restart { node }
                | FaultKind::Drain { node, .. } => node_ok(node),
                FaultKind::Partition { a, b, .. } | FaultKind::Clog { a, b } => {
                    a <= engines && b <= engines && a != b
                }
                FaultKind::Heal | FaultKind::Unclog => true,
            };
            if !(ok && f.at_s.is_finite() && f.at_s >= 0.0) {
                return bad(format!(
                    "fault {:?} at {} s names a node outside 0..={engines}",
                    f.kind, f.at_s
                ));
            }
        }
        Ok(())
    }
}
