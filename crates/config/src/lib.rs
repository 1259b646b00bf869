//! The TOML cluster config: tiers, tenants and their API keys, and engine
//! settings that the command line may override. Parsed and validated once;
//! an invalid file is refused with its line and the reason.
//!
//! ```toml
//! [engine]
//! max_num_seqs = 32
//!
//! [[tiers]]
//! name = "paid"
//! weight = 8
//! priority = 2
//! queue_len_max = 256
//!
//! [[tenants]]
//! name = "acme"
//! tier = "paid"
//! api_keys = ["sk-acme-example"]
//! max_concurrent = 64
//! ```
//!
//! A multi-node deployment adds `[cluster]` and `[[nodes]]` (see [`cluster`]).

pub mod cluster;
pub mod engine;

pub use cluster::{ClusterSection, NODES_MAX, Node, Role};

use std::collections::HashMap;
use std::path::Path;

use serde::Deserialize;

/// Why a config was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// TOML syntax or a field of the wrong type, with its line.
    #[error("{origin}:{line}: {message}")]
    Syntax {
        /// File name (or `"<string>"`).
        origin: String,
        /// 1-based line.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// Well-formed TOML that breaks a rule, with the line of the offending table where known.
    #[error("{origin}:{line}: {message}")]
    Invalid {
        /// File name (or `"<string>"`).
        origin: String,
        /// 1-based line (0 when unknown).
        line: usize,
        /// What is wrong.
        message: String,
    },
}

/// Engine settings a config file may set; command-line flags override them.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EngineSection {
    /// `--max-model-len`.
    pub max_model_len: Option<usize>,
    /// `--max-num-seqs`.
    pub max_num_seqs: Option<usize>,
    /// `--max-num-batched-tokens`.
    pub max_num_batched_tokens: Option<usize>,
    /// `--block-size`, tokens.
    pub block_size: Option<usize>,
    /// `--kv-cache-fraction` of free memory.
    pub kv_cache_fraction: Option<f64>,
    /// `--kv-cache-bytes`.
    pub kv_cache_bytes: Option<u64>,
    /// `--kv-cache-dtype`: f16, f32 or int8.
    pub kv_cache_dtype: Option<String>,
    /// `--queue-timeout`, seconds.
    pub queue_timeout_s: Option<f64>,
    /// `--speculative`: `ngram`, `self`, `draft` or `off`.
    pub speculative: Option<String>,
    /// `--draft-model`: the draft model of `--speculative draft` (a known
    /// name or a GGUF file's path); given alone, it means `draft`.
    pub draft_model: Option<String>,
    /// `--draft-vocab`: the draft model's logits cover the first this many
    /// token ids only (0: all).
    pub draft_vocab: Option<usize>,
    /// `--draft-p-min`: a draft model's guess less likely than this under
    /// the draft is not proposed.
    pub draft_p_min: Option<f64>,
    /// `--speculative-draft-layers`: layers a self-draft runs.
    pub speculative_draft_layers: Option<usize>,
    /// `--num-speculative-tokens`: most draft tokens per sequence per step.
    pub num_speculative_tokens: Option<usize>,
    /// `--speculative-max-batch`: speculate only in steps with at most this
    /// many decodes.
    pub speculative_max_batch: Option<usize>,
    /// `--kv-offload-bytes`: size of the KV offload tier (0: none).
    pub kv_offload_bytes: Option<u64>,
    /// `--kv-offload-path`: a file on local disk to hold the offload tier
    /// (mapped into memory) instead of RAM.
    pub kv_offload_path: Option<String>,
    /// `--step-time-max-ms`: longest a step carrying prefill chunks should
    /// take, by the measured step cost (chunks shrink to fit).
    pub step_time_max_ms: Option<f64>,
    /// `--decode-steps`: most decode steps one plan may run back to back
    /// when the batch is all decodes and nothing waits (1: none).
    pub decode_steps: Option<usize>,
}

/// A service tier.
#[derive(Clone, Debug, PartialEq)]
pub struct Tier {
    /// Name (unique).
    pub name: String,
    /// Share of the engine under contention, relative to other tiers (> 0).
    pub weight: u32,
    /// Preemption rank: higher is preempted later.
    pub priority: u8,
    /// Requests that may wait in this tier's queue; more get 503.
    pub queue_len_max: usize,
    /// KV blocks kept for this tier.
    pub kv_reserved_blocks: u32,
    /// Latency budget: while this tier has work, less protected tiers fill
    /// a step only up to this many tokens in all (the scheduler's
    /// `TierConfig::step_tokens_max`); `None`: no budget.
    pub step_tokens_max: Option<usize>,
    /// The same budget as a step time, in milliseconds, turned into tokens
    /// by the measured step cost (`TierConfig::step_time_max`).
    pub step_time_max_ms: Option<f64>,
}

/// A tenant: who an API key belongs to.
#[derive(Clone, Debug, PartialEq)]
pub struct Tenant {
    /// Name (unique).
    pub name: String,
    /// Index into [`ClusterConfig::tiers`].
    pub tier: usize,
    /// Keys that authenticate as this tenant.
    pub api_keys: Vec<String>,
    /// Share within its tier, relative to other tenants (> 0).
    pub weight: u32,
    /// Requests queued + running at once; more get 429 (0 = unlimited).
    pub max_concurrent: u32,
    /// Requests admitted per minute; more get 429.
    pub requests_per_minute: Option<u32>,
    /// Most KV blocks its sequences hold at once.
    pub kv_blocks_max: Option<u32>,
    /// Keep its prefix cache entries apart from other tenants'.
    pub isolate_prefix_cache: bool,
}

/// The validated config.
#[derive(Clone, Debug, PartialEq)]
pub struct ClusterConfig {
    /// Engine settings.
    pub engine: EngineSection,
    /// Tiers, in file order (their index is the tier id).
    pub tiers: Vec<Tier>,
    /// Tenants, in file order (their index is the tenant id).
    pub tenants: Vec<Tenant>,
    /// The nodes of a multi-node cluster; `None` when the file has no
    /// `[cluster]` and no `[[nodes]]`.
    pub cluster: Option<ClusterSection>,
    /// Traces (`[telemetry]`); flags override it.
    pub telemetry: TelemetrySection,
    /// The model and where it runs (`[model]`); flags override it.
    pub model: ModelSection,
    keys: HashMap<String, usize>,
}

/// `[model]`: what a node loads and how, so that a unit file or a pod
/// needs only `--config` and `--name`. Flags (`--model`, `--device`,
/// `--threads`, `--kernel`) override it.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// A model by name (`qwen2.5-coder-1.5b`) or a GGUF file's path
    /// (relative to the config file's directory when loaded from a file).
    pub model: Option<String>,
    /// `cpu`, `cuda` or `cuda:N`.
    pub device: Option<String>,
    /// Compute threads (at least 1; default: all cores).
    pub threads: Option<usize>,
    /// Matrix kernels (`auto`, `amx`, `avx512`, `avx2`, `scalar`, `exact`).
    pub kernel: Option<String>,
}

/// `[telemetry]`: where traces go. Flags (`--otlp-endpoint`,
/// `--otlp-sample-ratio`) override it.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TelemetrySection {
    /// `--otlp-endpoint`: base URL of an OTLP/HTTP receiver (spans go to
    /// `URL/v1/traces`); none: tracing is off.
    pub otlp_endpoint: Option<String>,
    /// `--otlp-sample-ratio`: fraction of new traces kept (default 1).
    pub otlp_sample_ratio: Option<f64>,
    /// Keys that `/metrics` and the detail of `/ready` ask for
    /// (`Authorization: Bearer KEY`; at least 16 characters, none a
    /// tenant's). None: both are open. Without a key `/ready` still
    /// answers its status code and `ready`, for probes.
    #[serde(default)]
    pub detail_keys: Vec<String>,
}

/// A file's top-level tables (unknown ones are refused by `parse`, which
/// names them: see [`ClusterConfig::parse_embedded`]).
#[derive(Deserialize)]
struct RawFile {
    #[serde(default)]
    engine: EngineSection,
    #[serde(default)]
    tiers: Vec<toml::Spanned<RawTier>>,
    #[serde(default)]
    tenants: Vec<toml::Spanned<RawTenant>>,
    cluster: Option<toml::Spanned<cluster::RawCluster>>,
    #[serde(default)]
    nodes: Vec<toml::Spanned<cluster::RawNode>>,
    #[serde(default)]
    telemetry: TelemetrySection,
    /// Read as [`ModelSection`] unless an embedding file owns `[model]`
    /// (a simulation scenario's model is its own).
    model: Option<toml::Spanned<toml::Value>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTier {
    name: String,
    #[serde(default = "one")]
    weight: u32,
    #[serde(default)]
    priority: u8,
    #[serde(default = "default_queue_len_max")]
    queue_len_max: usize,
    #[serde(default)]
    kv_reserved_blocks: u32,
    #[serde(default)]
    step_tokens_max: Option<usize>,
    #[serde(default)]
    step_time_max_ms: Option<f64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTenant {
    name: String,
    tier: String,
    #[serde(default)]
    api_keys: Vec<String>,
    #[serde(default = "one")]
    weight: u32,
    #[serde(default)]
    max_concurrent: u32,
    requests_per_minute: Option<u32>,
    kv_blocks_max: Option<u32>,
    #[serde(default)]
    isolate_prefix_cache: bool,
}

/// An operator's key (`[cluster] admin_keys`, `[telemetry] detail_keys`):
/// at least 16 characters, no whitespace or control characters.
pub(crate) fn operator_key_ok(k: &str) -> bool {
    k.len() >= 16 && !k.chars().any(|c| c.is_whitespace() || c.is_control())
}

fn one() -> u32 {
    1
}

fn default_queue_len_max() -> usize {
    1024
}

/// Largest queue a tier may declare: every queue is bounded.
pub const QUEUE_LEN_MAX_LIMIT: usize = 1 << 20;

/// Longest queue timeout, seconds: a client waiting longer is lost anyway,
/// and larger values overflow `Duration` arithmetic.
pub const QUEUE_TIMEOUT_S_MAX: f64 = 86_400.0;

/// Checks a queue timeout in seconds (file or command line): in
/// `(0, QUEUE_TIMEOUT_S_MAX]`.
pub fn check_queue_timeout_s(s: f64) -> Result<(), String> {
    if s > 0.0 && s <= QUEUE_TIMEOUT_S_MAX {
        Ok(())
    } else {
        Err(format!(
            "must be a number of seconds in (0, {QUEUE_TIMEOUT_S_MAX}]"
        ))
    }
}

/// Longest step time target, milliseconds.
pub const STEP_TIME_MS_MAX: f64 = 60_000.0;

/// Checks a step time target in milliseconds: in `(0, STEP_TIME_MS_MAX]`.
pub fn check_step_time_ms(ms: f64) -> Result<(), String> {
    if ms > 0.0 && ms <= STEP_TIME_MS_MAX {
        Ok(())
    } else {
        Err(format!(
            "must be a number of milliseconds in (0, {STEP_TIME_MS_MAX}]"
        ))
    }
}

/// Checks a KV cache fraction of available memory: in `(0, 1]`.
pub fn check_kv_cache_fraction(f: f64) -> Result<(), String> {
    if f > 0.0 && f <= 1.0 {
        Ok(())
    } else {
        Err("must be in (0, 1]".into())
    }
}

impl Tier {
    /// What a file's tier must be; `before` are the tiers ahead of it.
    fn check(&self, before: &[Tier]) -> Result<(), String> {
        if self.name.is_empty() {
            return Err("tier name is empty".into());
        }
        if before.iter().any(|o| o.name == self.name) {
            return Err(format!("tier '{}' is defined twice", self.name));
        }
        if self.weight == 0 {
            return Err(format!("tier '{}': weight must be > 0", self.name));
        }
        if self.queue_len_max == 0 || self.queue_len_max > QUEUE_LEN_MAX_LIMIT {
            return Err(format!(
                "tier '{}': queue_len_max must be in 1..={QUEUE_LEN_MAX_LIMIT}",
                self.name
            ));
        }
        if self.step_tokens_max == Some(0) {
            return Err(format!(
                "tier '{}': step_tokens_max must be at least 1 (omit it for no latency budget)",
                self.name
            ));
        }
        if let Some(ms) = self.step_time_max_ms {
            check_step_time_ms(ms)
                .map_err(|why| format!("tier '{}': step_time_max_ms {ms} {why}", self.name))?;
        }
        Ok(())
    }
}

impl Tenant {
    /// What a tenant must be (its keys are checked with the file's);
    /// `before` are the tenants ahead of it.
    fn check(&self, before: &[Tenant]) -> Result<(), String> {
        if self.name.is_empty() {
            return Err("tenant name is empty".into());
        }
        if before.iter().any(|o| o.name == self.name) {
            return Err(format!("tenant '{}' is defined twice", self.name));
        }
        if self.weight == 0 {
            return Err(format!("tenant '{}': weight must be > 0", self.name));
        }
        if self.requests_per_minute == Some(0) {
            return Err(format!(
                "tenant '{}': requests_per_minute must be > 0 (omit it for no limit)",
                self.name
            ));
        }
        Ok(())
    }
}

fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

impl ClusterConfig {
    /// Reads and validates a config file. A relative `cluster.certs_dir` is
    /// resolved against the file's directory.
    pub fn load(path: &Path) -> Result<ClusterConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let mut config = ClusterConfig::parse(&text, &path.display().to_string())?;
        let dir = path.parent().unwrap_or(Path::new(""));
        if let Some(c) = &mut config.cluster {
            if c.certs_dir.is_relative() {
                c.certs_dir = dir.join(&c.certs_dir);
            }
            if let Some(list) = &mut c.revocation_list
                && list.is_relative()
            {
                *list = dir.join(&*list);
            }
        }
        // A path (not a model name) is the config file's neighbour.
        if let Some(m) = &mut config.model.model
            && (m.contains('/') || m.ends_with(".gguf"))
            && Path::new(m.as_str()).is_relative()
        {
            *m = dir.join(m.as_str()).display().to_string();
        }
        Ok(config)
    }

    /// Parses and validates config text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<ClusterConfig, ConfigError> {
        ClusterConfig::parse_as(text, origin, None)
    }

    /// Parses the config tables of a file that holds more than a config
    /// (a simulation scenario): `[engine]`, `[[tiers]]`, `[[tenants]]`,
    /// `[cluster]` and `[telemetry]`, by the same code and with the same
    /// errors (line and field) as [`ClusterConfig::parse`]. The file's own
    /// top-level tables are `own` (any other is refused); its tenants need
    /// no API keys (nothing authenticates), and its `[cluster]` holds the
    /// timing and limits only (no `[[nodes]]`: the file places its nodes
    /// itself).
    pub fn parse_embedded(
        text: &str,
        origin: &str,
        own: &[&str],
    ) -> Result<ClusterConfig, ConfigError> {
        ClusterConfig::parse_as(text, origin, Some(own))
    }

    fn parse_as(
        text: &str,
        origin: &str,
        embedded: Option<&[&str]>,
    ) -> Result<ClusterConfig, ConfigError> {
        let syntax = |e: toml::de::Error| ConfigError::Syntax {
            origin: origin.to_string(),
            line: e.span().map(|s| line_of(text, s.start)).unwrap_or(0),
            message: e.message().to_string(),
        };
        let raw: RawFile = toml::from_str(text).map_err(syntax)?;
        let invalid = |offset: usize, message: String| ConfigError::Invalid {
            origin: origin.to_string(),
            line: line_of(text, offset),
            message,
        };
        // Top-level tables: the config's, and an embedding file's own.
        let ours = [
            "engine",
            "tiers",
            "tenants",
            "cluster",
            "nodes",
            "telemetry",
            "model",
        ];
        let top: std::collections::BTreeMap<toml::Spanned<String>, serde::de::IgnoredAny> =
            toml::from_str(text).map_err(syntax)?;
        for key in top.keys() {
            let k = key.get_ref().as_str();
            if !ours.contains(&k) && !embedded.unwrap_or(&[]).contains(&k) {
                let mut expected: Vec<&str> = ours.to_vec();
                expected.extend(embedded.unwrap_or(&[]));
                return Err(ConfigError::Syntax {
                    origin: origin.to_string(),
                    line: line_of(text, key.span().start),
                    message: format!(
                        "unknown field `{k}`, expected one of {}",
                        expected
                            .iter()
                            .map(|e| format!("`{e}`"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                });
            }
        }
        if embedded.is_some() && !raw.nodes.is_empty() {
            return Err(invalid(
                raw.nodes[0].span().start,
                "[[nodes]] in a file that places its own nodes".into(),
            ));
        }
        if raw.tiers.is_empty() {
            return Err(invalid(
                0,
                "at least one [[tiers]] table is required".into(),
            ));
        }
        if raw.tiers.len() > u8::MAX as usize {
            return Err(invalid(0, "at most 255 tiers".into()));
        }
        let mut tiers: Vec<Tier> = Vec::new();
        for t in &raw.tiers {
            let at = t.span().start;
            let t = t.get_ref();
            let tier = Tier {
                name: t.name.clone(),
                weight: t.weight,
                priority: t.priority,
                queue_len_max: t.queue_len_max,
                kv_reserved_blocks: t.kv_reserved_blocks,
                step_tokens_max: t.step_tokens_max,
                step_time_max_ms: t.step_time_max_ms,
            };
            tier.check(&tiers).map_err(|m| invalid(at, m))?;
            tiers.push(tier);
        }
        let mut tenants: Vec<Tenant> = Vec::new();
        let mut keys = HashMap::new();
        for t in &raw.tenants {
            let at = t.span().start;
            let t = t.get_ref();
            let Some(tier) = tiers.iter().position(|x| x.name == t.tier) else {
                let names: Vec<&str> = tiers.iter().map(|x| x.name.as_str()).collect();
                return Err(invalid(
                    at,
                    format!(
                        "tenant '{}': unknown tier '{}' (tiers: {})",
                        t.name,
                        t.tier,
                        names.join(", ")
                    ),
                ));
            };
            let tenant = Tenant {
                name: t.name.clone(),
                tier,
                api_keys: t.api_keys.clone(),
                weight: t.weight,
                max_concurrent: t.max_concurrent,
                requests_per_minute: t.requests_per_minute,
                kv_blocks_max: t.kv_blocks_max,
                isolate_prefix_cache: t.isolate_prefix_cache,
            };
            tenant.check(&tenants).map_err(|m| invalid(at, m))?;
            for k in &t.api_keys {
                if k.len() < 8 || k.chars().any(|c| c.is_whitespace() || c.is_control()) {
                    return Err(invalid(
                        at,
                        format!(
                            "tenant '{}': API keys need at least 8 characters and no whitespace",
                            t.name
                        ),
                    ));
                }
                if keys.insert(k.clone(), tenants.len()).is_some() {
                    return Err(invalid(
                        at,
                        format!("tenant '{}': an API key is used by two tenants", t.name),
                    ));
                }
            }
            tenants.push(tenant);
        }
        if tenants.is_empty() {
            // No tenants: the deployment runs open as one default tenant of
            // the first tier.
            tenants.push(Tenant::open_default(0));
        } else if keys.is_empty() && embedded.is_none() {
            return Err(invalid(
                0,
                "tenants are defined but none has api_keys: give each tenant keys, or define no tenants to run open"
                    .into(),
            ));
        }
        let e = &raw.engine;
        if let Some(f) = e.kv_cache_fraction
            && let Err(why) = check_kv_cache_fraction(f)
        {
            return Err(invalid(0, format!("engine.kv_cache_fraction {f} {why}")));
        }
        if let Some(q) = e.queue_timeout_s
            && let Err(why) = check_queue_timeout_s(q)
        {
            return Err(invalid(0, format!("engine.queue_timeout_s {q} {why}")));
        }
        if let Some(d) = &e.kv_cache_dtype
            && let Err(why) = flotilla_proto::KvDtype::parse(d)
        {
            return Err(invalid(0, format!("engine.kv_cache_dtype: {why}")));
        }
        if let Some(r) = raw.telemetry.otlp_sample_ratio
            && !(0.0..=1.0).contains(&r)
        {
            return Err(invalid(
                0,
                format!("telemetry.otlp_sample_ratio {r}: expected a number in 0..=1"),
            ));
        }
        if raw
            .telemetry
            .detail_keys
            .iter()
            .any(|k| !operator_key_ok(k))
        {
            return Err(invalid(
                0,
                "telemetry.detail_keys need at least 16 characters and no whitespace".into(),
            ));
        }
        if raw
            .telemetry
            .detail_keys
            .iter()
            .any(|k| keys.contains_key(k))
        {
            return Err(invalid(
                0,
                "telemetry.detail_keys: a key is also a tenant's API key: give operators their own"
                    .into(),
            ));
        }
        let model = match (&raw.model, embedded) {
            (Some(_), Some(own)) if own.contains(&"model") => ModelSection::default(),
            (Some(v), _) => ModelSection::deserialize(v.get_ref().clone())
                .map_err(|e| invalid(v.span().start, format!("[model] {}", e.message())))?,
            (None, _) => ModelSection::default(),
        };
        if model.threads == Some(0) {
            return Err(invalid(0, "model.threads must be at least 1".into()));
        }
        if model.model.as_deref().is_some_and(|m| m.trim().is_empty()) {
            return Err(invalid(
                0,
                "model.model is empty: a model name or a GGUF file's path".into(),
            ));
        }
        let cluster = match (embedded, raw.cluster.as_ref()) {
            // Timing and limits only: the embedding file places the nodes.
            (Some(_), Some(c)) => Some(cluster::settings(Some(c), &invalid)?),
            (Some(_), None) => None,
            (None, c) => cluster::validate(c, &raw.nodes, &invalid)?,
        };
        if let Some(c) = &cluster
            && c.admin_keys.iter().any(|k| keys.contains_key(k))
        {
            let at = raw.cluster.as_ref().map_or(0, |c| c.span().start);
            return Err(invalid(
                at,
                "[cluster] an admin key is also a tenant's API key: give admins their own keys"
                    .into(),
            ));
        }
        Ok(ClusterConfig {
            engine: raw.engine,
            tiers,
            tenants,
            cluster,
            telemetry: raw.telemetry,
            model,
            keys,
        })
    }

    /// A config built in code (the simulator's scenario), checked as a
    /// file's tiers and tenants are; no API keys: it runs open.
    pub fn from_parts(
        engine: EngineSection,
        tiers: Vec<Tier>,
        tenants: Vec<Tenant>,
    ) -> Result<ClusterConfig, String> {
        if tiers.is_empty() || tiers.len() > u8::MAX as usize {
            return Err(format!("{} tiers: 1..=255 are needed", tiers.len()));
        }
        for (i, t) in tiers.iter().enumerate() {
            t.check(&tiers[..i])?;
        }
        for (i, t) in tenants.iter().enumerate() {
            if t.tier >= tiers.len() {
                return Err(format!("tenant '{}': no tier {}", t.name, t.tier));
            }
            if !t.api_keys.is_empty() {
                return Err(format!(
                    "tenant '{}': a config built in code has no keys",
                    t.name
                ));
            }
            t.check(&tenants[..i])?;
        }
        let tenants = if tenants.is_empty() {
            vec![Tenant::open_default(0)]
        } else {
            tenants
        };
        Ok(ClusterConfig {
            engine,
            tiers,
            tenants,
            cluster: None,
            telemetry: TelemetrySection::default(),
            model: ModelSection::default(),
            keys: HashMap::new(),
        })
    }

    /// A config with one tier and one tenant and no keys: every request is
    /// the default tenant's.
    pub fn open() -> ClusterConfig {
        ClusterConfig {
            engine: EngineSection::default(),
            tiers: vec![Tier {
                name: "default".into(),
                weight: 1,
                priority: 0,
                queue_len_max: default_queue_len_max(),
                kv_reserved_blocks: 0,
                step_tokens_max: None,
                step_time_max_ms: None,
            }],
            tenants: vec![Tenant::open_default(0)],
            cluster: None,
            telemetry: TelemetrySection::default(),
            model: ModelSection::default(),
            keys: HashMap::new(),
        }
    }

    /// True when no API keys are configured: requests need no key.
    pub fn is_open(&self) -> bool {
        self.keys.is_empty()
    }

    /// The tenant a key belongs to.
    pub fn tenant_for_key(&self, key: &str) -> Option<usize> {
        self.keys.get(key).copied()
    }
}

impl Tenant {
    fn open_default(tier: usize) -> Tenant {
        Tenant {
            name: "default".into(),
            tier,
            api_keys: Vec::new(),
            weight: 1,
            max_concurrent: 0,
            requests_per_minute: None,
            kv_blocks_max: None,
            isolate_prefix_cache: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `[model]` names what a node loads; a relative path is read beside
    /// the config file (a name stays a name); bad values are refused.
    #[test]
    fn a_model_section_names_what_a_node_loads() {
        let text = "[model]\nmodel = \"models/m.gguf\"\ndevice = \"cuda:1\"\nthreads = 4\n\
                    kernel = \"avx2\"\n\n[[tiers]]\nname = \"paid\"\n";
        let c = ClusterConfig::parse(text, "c.toml").unwrap();
        assert_eq!(c.model.model.as_deref(), Some("models/m.gguf"));
        assert_eq!(c.model.device.as_deref(), Some("cuda:1"));
        assert_eq!(
            (c.model.threads, c.model.kernel.as_deref()),
            (Some(4), Some("avx2"))
        );
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("cluster.toml");
        std::fs::write(&f, text).unwrap();
        let c = ClusterConfig::load(&f).unwrap();
        assert_eq!(
            c.model.model.as_deref(),
            Some(dir.path().join("models/m.gguf").to_str().unwrap())
        );
        std::fs::write(&f, text.replace("models/m.gguf", "qwen2.5-coder-1.5b")).unwrap();
        let c = ClusterConfig::load(&f).unwrap();
        assert_eq!(c.model.model.as_deref(), Some("qwen2.5-coder-1.5b"));
        for (bad, why) in [
            ("threads = 4", "model.threads must be at least 1"),
            ("model = \"models/m.gguf\"", "model.model is empty"),
        ] {
            let good = if bad.starts_with("threads") {
                "threads = 0"
            } else {
                "model = \" \""
            };
            let e = ClusterConfig::parse(&text.replace(bad, good), "c.toml")
                .unwrap_err()
                .to_string();
            assert!(e.contains(why), "{e}");
        }
        let e = ClusterConfig::parse(&text.replace("threads = 4", "thread = 4"), "c.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("thread"), "{e}");
    }

    const GOOD: &str = r#"
[engine]
max_num_seqs = 32

[[tiers]]
name = "paid"
weight = 8
priority = 2

[[tiers]]
name = "free"
queue_len_max = 16

[[tenants]]
name = "acme"
tier = "paid"
api_keys = ["sk-acme-0001"]

[[tenants]]
name = "hobby"
tier = "free"
api_keys = ["sk-hobby-001", "sk-hobby-002"]
max_concurrent = 4
"#;

    #[test]
    fn parses_tiers_tenants_keys() {
        let c = ClusterConfig::parse(GOOD, "t").unwrap();
        assert_eq!(c.engine.max_num_seqs, Some(32));
        assert_eq!(c.tiers.len(), 2);
        assert_eq!(c.tiers[1].weight, 1);
        assert_eq!(c.tiers[1].queue_len_max, 16);
        assert_eq!(c.tenant_for_key("sk-hobby-002"), Some(1));
        assert_eq!(c.tenant_for_key("sk-nope-0000"), None);
        assert_eq!(c.tenants[1].tier, 1);
        assert!(!c.is_open());
    }

    #[test]
    fn no_tenants_runs_open() {
        let c = ClusterConfig::parse("[[tiers]]\nname = \"t\"\n", "t").unwrap();
        assert!(c.is_open());
        assert_eq!(c.tenants.len(), 1);
        assert!(ClusterConfig::open().is_open());
    }

    fn err_of(text: &str) -> String {
        ClusterConfig::parse(text, "f.toml")
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn refusals_name_line_and_reason() {
        let bad_tier = GOOD.replace("tier = \"free\"", "tier = \"gold\"");
        let e = err_of(&bad_tier);
        assert!(e.starts_with("f.toml:"), "{e}");
        assert!(e.contains("unknown tier 'gold'"), "{e}");
        let line: usize = e.split(':').nth(1).unwrap().parse().unwrap();
        assert_eq!(
            bad_tier.lines().nth(line - 1).unwrap(),
            "[[tenants]]",
            "{e}"
        );

        let e = err_of(&GOOD.replace("weight = 8", "weight = \"x\""));
        assert!(e.contains("f.toml:7"), "{e}");
        assert!(err_of(&GOOD.replace("weight = 8", "wieght = 8")).contains("wieght"));
        assert!(err_of(&GOOD.replace("sk-hobby-002", "sk-acme-0001")).contains("two tenants"));
        assert!(err_of(&GOOD.replace("sk-hobby-002", "short")).contains("8 characters"));
        assert!(err_of(&GOOD.replace("weight = 8", "weight = 0")).contains("weight must be > 0"));
        assert!(err_of("").contains("at least one [[tiers]]"));
        let long = GOOD.replace("max_num_seqs = 32", "queue_timeout_s = 100000.0");
        assert!(err_of(&long).contains("(0, 86400]"), "{}", err_of(&long));
        assert!(err_of("[[tiers]]\nname = \"a\"\n[[tiers]]\nname = \"a\"\n").contains("twice"));
        assert!(err_of(&format!("{GOOD}\n[engine2]\n")).contains("engine2"));
        // A latency budget: a positive number of tokens, into the scheduler.
        let budget = GOOD.replace("weight = 8", "weight = 8\nstep_tokens_max = 6");
        let c = ClusterConfig::parse(&budget, "f.toml").unwrap();
        assert_eq!(c.tiers[0].step_tokens_max, Some(6));
        assert!(c.tiers[1..].iter().all(|t| t.step_tokens_max.is_none()));
        // ... or a time, turned into tokens by the measured step cost.
        let timed = GOOD.replace("weight = 8", "weight = 8\nstep_time_max_ms = 18.5");
        let c = ClusterConfig::parse(&timed, "f.toml").unwrap();
        assert_eq!(c.tiers[0].step_time_max_ms, Some(18.5));
        for bad in ["0", "-3", "1e9"] {
            let e = err_of(&GOOD.replace(
                "weight = 8",
                &format!("weight = 8\nstep_time_max_ms = {bad}"),
            ));
            assert!(
                e.contains("step_time_max_ms") && e.contains("milliseconds in (0, 60000]"),
                "{e}"
            );
        }
        let e = err_of(&GOOD.replace("weight = 8", "weight = 8\nstep_tokens_max = 0"));
        assert!(e.contains("step_tokens_max must be at least 1"), "{e}");
        let e = err_of(&format!("{GOOD}\n[telemetry]\notlp_sample_ratio = 2.0\n"));
        assert!(e.contains("telemetry.otlp_sample_ratio 2"), "{e}");
    }

    #[test]
    fn shipped_configs_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../cluster-configs");
        let mut n = 0;
        let mut clusters = 0;
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "toml") {
                let c = ClusterConfig::load(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                if let Some(cluster) = &c.cluster {
                    assert_eq!(cluster.router().1.role, Role::Router, "{}", p.display());
                    assert!(cluster.router().1.http.is_some(), "{}", p.display());
                    assert!(
                        cluster.engines().count() >= 1 || cluster.allow_join,
                        "{}",
                        p.display()
                    );
                    clusters += 1;
                }
                n += 1;
            }
        }
        assert!(n >= 1, "no configs in {}", dir.display());
        // two-workers.toml and k8s.toml at least.
        assert!(
            clusters >= 2,
            "{clusters} cluster configs in {}",
            dir.display()
        );
    }

    /// deploy/k8s/config.yaml carries cluster-configs/k8s.toml inline
    /// (kustomize reads no file outside its directory); the copy must not
    /// drift, and its workers must be the StatefulSet's pods.
    /// The TOML inlined in a ConfigMap manifest under `  cluster.toml: |`.
    fn configmap_toml(yaml: &str) -> String {
        let mut lines = yaml.lines();
        lines
            .by_ref()
            .find(|l| *l == "  cluster.toml: |")
            .expect("the ConfigMap has a `  cluster.toml: |` block");
        let inline: Vec<&str> = lines
            .take_while(|l| l.is_empty() || l.starts_with("    "))
            .map(|l| l.strip_prefix("    ").unwrap_or(l))
            .collect();
        inline.join("\n").trim_end().to_owned()
    }

    /// `key: N` on a line of a manifest, at the given indentation.
    fn manifest_number(yaml: &str, key: &str) -> usize {
        yaml.lines()
            .find_map(|l| l.strip_prefix(key))
            .unwrap_or_else(|| panic!("{key}"))
            .trim()
            .trim_matches('"')
            .parse()
            .unwrap()
    }

    /// A node's name and address.
    type NameAddr = (String, String);

    /// The engine nodes of a config as (name, addr), and those the worker
    /// StatefulSet's first `n` pods have.
    fn engines_and_pods(c: &ClusterConfig, n: usize) -> (Vec<NameAddr>, Vec<NameAddr>) {
        let cluster = c.cluster.clone().unwrap();
        assert_eq!(cluster.certs_dir, Path::new("/etc/flotilla/certs"));
        // The routers are the router StatefulSet's two pods.
        let routers: Vec<NameAddr> = cluster
            .routers()
            .map(|(_, n)| (n.name.clone(), n.addr.clone()))
            .collect();
        let router_pods: Vec<NameAddr> = (0..2)
            .map(|i| {
                (
                    format!("flotilla-router-{i}"),
                    format!("flotilla-router-{i}.flotilla-router-peers:7400"),
                )
            })
            .collect();
        assert_eq!(routers, router_pods);
        let engines = cluster
            .engines()
            .map(|(_, n)| (n.name.clone(), n.addr.clone()))
            .collect();
        let pods = (0..n)
            .map(|i| {
                (
                    format!("flotilla-worker-{i}"),
                    format!("flotilla-worker-{i}.flotilla-worker:7400"),
                )
            })
            .collect();
        (engines, pods)
    }

    #[test]
    fn k8s_configmaps_match_shipped_tomls() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let read = |p: &str| std::fs::read_to_string(root.join(p)).unwrap();
        // The base: as many worker nodes as the StatefulSet has replicas.
        let toml = read("cluster-configs/k8s.toml");
        assert_eq!(
            configmap_toml(&read("deploy/k8s/config.yaml")),
            toml.trim_end(),
            "deploy/k8s/config.yaml and cluster-configs/k8s.toml differ"
        );
        let c = ClusterConfig::parse(&toml, "k8s.toml").unwrap();
        assert_eq!(
            manifest_number(&read("deploy/k8s/router.yaml"), "  replicas: "),
            2,
            "one router pod per router node"
        );
        let replicas = manifest_number(&read("deploy/k8s/workers.yaml"), "  replicas: ");
        let (engines, pods) = engines_and_pods(&c, replicas);
        assert_eq!(engines, pods);
        // The autoscaling overlay: the routers only (workers join at run
        // time, the pods run `--join`), the base's replicas as its minimum.
        let toml = read("cluster-configs/k8s-autoscaling.toml");
        assert_eq!(
            configmap_toml(&read("deploy/k8s/autoscaling/config.yaml")),
            toml.trim_end(),
            "deploy/k8s/autoscaling/config.yaml and cluster-configs/k8s-autoscaling.toml differ"
        );
        let hpa = read("deploy/k8s/autoscaling/hpa.yaml");
        assert_eq!(manifest_number(&hpa, "  minReplicas: "), replicas);
        assert!(manifest_number(&hpa, "  maxReplicas: ") > replicas);
        let c = ClusterConfig::parse(&toml, "k8s-autoscaling.toml").unwrap();
        let (engines, _) = engines_and_pods(&c, 0);
        assert_eq!(engines, vec![], "the workers join: none is declared");
        let cl = c.cluster.clone().unwrap();
        assert!(cl.allow_join);
        let kust = read("deploy/k8s/autoscaling/kustomization.yaml");
        for arg in [
            "--join",
            "flotilla-router-0,flotilla-router-1",
            "--listen",
            "--metrics-addr",
        ] {
            assert!(
                kust.contains(&format!("- {arg}")),
                "the overlay's worker pods run {arg}"
            );
        }
        // Everything else is the base's.
        let base = ClusterConfig::parse(&read("cluster-configs/k8s.toml"), "k8s.toml").unwrap();
        assert_eq!(
            (c.engine, c.tiers.len(), c.tenants.len()),
            (base.engine, base.tiers.len(), base.tenants.len())
        );
        for m in ["flotilla_queue_length", "flotilla_ttft_p90_seconds"] {
            assert!(hpa.contains(m), "hpa.yaml scales on {m}");
            assert!(
                read("deploy/k8s/autoscaling/prometheus-adapter-values.yaml")
                    .contains(&format!("as: {m}")),
                "prometheus-adapter serves {m}"
            );
        }
    }
}
