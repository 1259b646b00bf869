//! The scheduler's typed config and its one validation pass.

use std::collections::BTreeSet;
use std::time::Duration;

use flotilla_proto::TierId;

/// One service tier (paid, free, internal ...).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierConfig {
    /// Name, unique among tiers (metrics, errors).
    pub name: String,
    /// Share of admissions and seats relative to other tiers with demand (> 0).
    pub weight: u32,
    /// Preemption rank: a higher value is more protected and may preempt lower ones.
    pub priority: u8,
    /// Most requests waiting in this tier's queue; more are refused with `QueueFull`.
    pub queue_len_max: usize,
    /// KV blocks other tiers may never take from this tier.
    pub kv_reserved_blocks: u32,
    /// A latency budget for this tier, in tokens per step: while it has
    /// work (running or waiting) and no more protected tier does, less
    /// protected tiers' work fills a step only up to this many tokens in
    /// all (this tier's own work is not limited by it). Fewer lower-tier
    /// decodes (taking turns) and smaller lower-tier chunks per step keep
    /// this tier's TPOT and TTFT near their unloaded values, traded against
    /// lower-tier throughput. `None`: steps are filled as usual.
    pub step_tokens_max: Option<usize>,
    /// The same latency budget as a time: the most tokens a step may hold
    /// to take this long by the step cost measured so far
    /// (`Scheduler::observe_step`), so one setting holds on any machine.
    /// With `step_tokens_max` too, the smaller of the two applies.
    pub step_time_max: Option<Duration>,
}

/// One tenant (an API key's owner).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantConfig {
    /// Name, unique among tenants (errors, metrics).
    pub name: String,
    /// Its tier, an index into [`SchedConfig::tiers`].
    pub tier: TierId,
    /// Share of service relative to other tenants of its tier (> 0).
    pub weight: u32,
    /// Most requests queued plus running at once; 0 means unlimited.
    pub max_concurrent: u32,
    /// Sustained admission rate, requests per minute (burst of the same size); `None` = unlimited.
    pub requests_per_minute: Option<u32>,
    /// Most KV blocks it may hold at once; `None` = no quota.
    pub kv_blocks_max: Option<u32>,
    /// Prefix-cache namespace; 0 shares cached prefixes with every other salt-0 tenant.
    pub prefix_salt: u64,
}

/// How requests join the running batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Batching {
    /// Requests join and leave the batch at every step (vLLM, TGI).
    Continuous,
    /// A batch is admitted only when the previous one has fully drained (a baseline).
    Static,
}

/// Speculative decoding: draft tokens proposed from the sequence's own
/// text (n-gram prompt lookup) and verified in the next step beside
/// everything else (see [`crate::Scheduler::schedule`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Speculation {
    /// Most draft tokens per sequence per step; 0 turns speculation off.
    pub max_draft: usize,
    /// Longest n-gram (the sequence's last tokens) looked up earlier in it.
    pub ngram_max: usize,
    /// Shortest n-gram tried when no longer one matches (at least 1).
    pub ngram_min: usize,
    /// Speculate only in steps with at most this many decodes: above it a
    /// step is no longer bound by reading the weights, and verify
    /// positions cost nearly as much as the tokens they might save.
    pub max_batch: usize,
    /// Most draft tokens in one step, all sequences together: the
    /// backend's output rows past one per sequence
    /// (`Executor::max_draft_tokens`, set by the engine).
    pub max_step: usize,
    /// A self-draft where the n-gram lookup finds nothing: the model's
    /// first `self_layers` layers, then its final norm and head, guess
    /// the draft (`PlanItem::self_draft`; the GpuWorker runs those passes
    /// before the step). 0: n-gram drafts only. [`SELF_LAYERS_DEFAULT`]
    /// until the engine, which knows the model, resolves it.
    pub self_layers: usize,
    /// A draft model guesses where the n-gram lookup finds nothing
    /// (`PlanItem::model_draft`; the GpuWorker holds the model and runs
    /// its passes before the step). How many tokens it drafts is the cost
    /// sum's answer ([`crate::best_draft`]) from the measured step costs
    /// and acceptance, up to `max_draft`, in steps of any size
    /// (`max_batch` bounds the n-gram drafts only).
    pub draft_model: bool,
    /// A draft model's guess whose probability under the draft is below
    /// this is not proposed, and its sequence drafts no further that step
    /// (0: every guess up to the length is proposed).
    pub draft_p_min: f32,
}

/// `Speculation::draft_p_min` unless told otherwise.
pub const DRAFT_P_MIN: f32 = 0.5;

/// `Speculation::self_layers` before the engine resolves it: three
/// quarters of the model's layers.
pub const SELF_LAYERS_DEFAULT: usize = usize::MAX;

impl Speculation {
    /// No speculation.
    pub const OFF: Speculation = Speculation {
        max_draft: 0,
        ngram_max: 0,
        ngram_min: 0,
        max_batch: 0,
        max_step: 0,
        self_layers: 0,
        draft_model: false,
        draft_p_min: 0.0,
    };

    /// N-gram prompt lookup with `max_draft` tokens per step.
    pub fn ngram(max_draft: usize) -> Speculation {
        Speculation {
            max_draft,
            ngram_max: 4,
            ngram_min: 2,
            max_batch: 2,
            max_step: usize::MAX,
            self_layers: 0,
            draft_model: false,
            draft_p_min: 0.0,
        }
    }

    /// N-gram prompt lookup, and a draft model's guess where it finds
    /// nothing.
    pub fn draft_model(max_draft: usize) -> Speculation {
        Speculation {
            draft_model: true,
            draft_p_min: DRAFT_P_MIN,
            ..Speculation::ngram(max_draft)
        }
    }

    /// N-gram prompt lookup, and a self-draft through the model's first
    /// `layers` layers where it finds nothing.
    pub fn self_draft(max_draft: usize, layers: usize) -> Speculation {
        Speculation {
            self_layers: layers,
            ..Speculation::ngram(max_draft)
        }
    }

    /// Whether it is on.
    pub fn is_on(&self) -> bool {
        self.max_draft > 0
    }
}

impl Default for Speculation {
    fn default() -> Self {
        Speculation::OFF
    }
}

/// Everything the scheduler of one engine needs, validated by [`SchedConfig::validate`].
#[derive(Clone, Debug, PartialEq)]
pub struct SchedConfig {
    /// KV blocks in the pool (> 0).
    pub num_blocks: u32,
    /// Tokens per KV block (> 0).
    pub block_size: u32,
    /// Most sequences in the running batch (> 0).
    pub max_num_seqs: usize,
    /// Token budget of one step, prefill chunks and decodes together (> 0).
    pub max_num_batched_tokens: usize,
    /// Longest sequence, prompt plus output, in tokens (> 0).
    pub max_model_len: usize,
    /// Continuous or static batching.
    pub batching: Batching,
    /// Longest a request may wait before it is first scheduled (> 0).
    pub queue_timeout: Duration,
    /// The model's end-of-sequence tokens (ignored by `ignore_eos` requests).
    pub stop_tokens: Vec<u32>,
    /// Tiers; `TierId(i)` is `tiers[i]` (1..=256 of them).
    pub tiers: Vec<TierConfig>,
    /// Tenants; `TenantId(i)` is `tenants[i]`.
    pub tenants: Vec<TenantConfig>,
    /// Speculative decoding (off by default).
    pub speculation: Speculation,
    /// Blocks of the KV pool's offload tier (0: none): evicted prefix
    /// blocks (a preempted sequence's among them) spill there and come
    /// back on a hit.
    pub offload_blocks: u32,
    /// Longest a step that carries prefill chunks or draft tokens should
    /// take, by the step cost measured so far: chunks (and drafts) shrink
    /// so that a prompt never stalls the running decodes past it. Decodes
    /// are never cut for it, and prompts still advance by at least one
    /// block per step. `None`: chunks fill `max_num_batched_tokens`.
    pub step_time_max: Option<Duration>,
    /// Most decode steps one plan may hold (1..=[`DECODE_STEPS_MAX`]; 1:
    /// a plan is one step). When every running sequence decodes, nothing
    /// waits and no sequence has a draft, a constraint, a bias or a stop
    /// token to watch for, a plan may ask for up to this many steps of the
    /// same batch back to back (multi-step decode): the executor's worker
    /// feeds each step's samples to the next and stops early, after the
    /// step in progress, when the Scheduler is told anything (a request
    /// arrives, one is cancelled, KV comes or goes). The tokens reach
    /// clients when the plan ends. The simulator uses it to advance many
    /// tokens per event.
    pub decode_steps: usize,
}

/// The most decode steps one plan may hold (`SchedConfig::decode_steps`).
pub const DECODE_STEPS_MAX: usize = 256;

/// Why a scheduler config was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// A size or limit that must be positive is zero.
    #[error("{field} must be greater than zero")]
    Zero {
        /// The config field.
        field: &'static str,
    },
    /// No tier, or more than `TierId` can name.
    #[error("the scheduler needs 1 to 256 tiers, got {count}")]
    TierCount {
        /// Tiers configured.
        count: usize,
    },
    /// More tenants than `TenantId` can name.
    #[error("too many tenants ({count})")]
    TenantCount {
        /// Tenants configured.
        count: usize,
    },
    /// Two tiers or two tenants share a name.
    #[error("duplicate {kind} name '{name}'")]
    DuplicateName {
        /// `tier` or `tenant`.
        kind: &'static str,
        /// The repeated name.
        name: String,
    },
    /// A tier field that must be positive is zero.
    #[error("tier '{tier}': {field} must be greater than zero")]
    TierField {
        /// Tier name.
        tier: String,
        /// The field.
        field: &'static str,
    },
    /// A tenant field that must be positive is zero.
    #[error("tenant '{tenant}': {field} must be greater than zero")]
    TenantField {
        /// Tenant name.
        tenant: String,
        /// The field.
        field: &'static str,
    },
    /// A tenant names a tier that does not exist.
    #[error("tenant '{tenant}' is in tier {tier}, but only {tiers} tiers exist")]
    UnknownTier {
        /// Tenant name.
        tenant: String,
        /// The tier index it names.
        tier: u8,
        /// Tiers configured.
        tiers: usize,
    },
    /// More decode steps per plan than [`DECODE_STEPS_MAX`].
    #[error("decode_steps {0} must be at most {DECODE_STEPS_MAX}")]
    DecodeSteps(usize),
    /// Speculation settings that cannot work.
    #[error("speculative decoding: {0}")]
    Speculation(String),
    /// The KV pool refused its part of the config.
    #[error("KV pool: {0}")]
    Pool(#[from] flotilla_kv::ConfigError),
}

impl SchedConfig {
    /// Checks every field; the pool's own checks run when it is built.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive: [(&'static str, bool); 8] = [
            ("num_blocks", self.num_blocks > 0),
            ("block_size", self.block_size > 0),
            ("max_num_seqs", self.max_num_seqs > 0),
            ("max_num_batched_tokens", self.max_num_batched_tokens > 0),
            ("max_model_len", self.max_model_len > 0),
            ("queue_timeout", !self.queue_timeout.is_zero()),
            ("step_time_max", self.step_time_max != Some(Duration::ZERO)),
            ("decode_steps", self.decode_steps > 0),
        ];
        if let Some((field, _)) = positive.iter().find(|(_, ok)| !ok) {
            return Err(ConfigError::Zero { field });
        }
        if self.decode_steps > DECODE_STEPS_MAX {
            return Err(ConfigError::DecodeSteps(self.decode_steps));
        }
        if self.tiers.is_empty() || self.tiers.len() > usize::from(u8::MAX) + 1 {
            return Err(ConfigError::TierCount {
                count: self.tiers.len(),
            });
        }
        let spec = &self.speculation;
        if spec.is_on() && (spec.ngram_min == 0 || spec.ngram_min > spec.ngram_max) {
            return Err(ConfigError::Speculation(format!(
                "n-gram sizes must satisfy 1 <= min <= max, got {}..={}",
                spec.ngram_min, spec.ngram_max
            )));
        }
        if spec.is_on() && spec.max_draft >= self.max_num_batched_tokens {
            return Err(ConfigError::Speculation(format!(
                "{} draft tokens do not fit a step of {} tokens with their decode",
                spec.max_draft, self.max_num_batched_tokens
            )));
        }
        if u32::try_from(self.tenants.len()).is_err() {
            return Err(ConfigError::TenantCount {
                count: self.tenants.len(),
            });
        }
        let mut names = BTreeSet::new();
        for t in &self.tiers {
            if !names.insert(t.name.as_str()) {
                return Err(ConfigError::DuplicateName {
                    kind: "tier",
                    name: t.name.clone(),
                });
            }
            let bad = |field| ConfigError::TierField {
                tier: t.name.clone(),
                field,
            };
            if t.weight == 0 {
                return Err(bad("weight"));
            }
            if t.queue_len_max == 0 {
                return Err(bad("queue_len_max"));
            }
            if t.step_tokens_max == Some(0) {
                return Err(bad("step_tokens_max"));
            }
            if t.step_time_max == Some(Duration::ZERO) {
                return Err(bad("step_time_max"));
            }
        }
        names.clear();
        for t in &self.tenants {
            if !names.insert(t.name.as_str()) {
                return Err(ConfigError::DuplicateName {
                    kind: "tenant",
                    name: t.name.clone(),
                });
            }
            if usize::from(t.tier.0) >= self.tiers.len() {
                return Err(ConfigError::UnknownTier {
                    tenant: t.name.clone(),
                    tier: t.tier.0,
                    tiers: self.tiers.len(),
                });
            }
            let bad = |field| ConfigError::TenantField {
                tenant: t.name.clone(),
                field,
            };
            if t.weight == 0 {
                return Err(bad("weight"));
            }
            if t.requests_per_minute == Some(0) {
                return Err(bad("requests_per_minute"));
            }
            if t.kv_blocks_max == Some(0) {
                return Err(bad("kv_blocks_max"));
            }
        }
        Ok(())
    }

    /// The KV pool's part of the config.
    pub(crate) fn pool_config(&self) -> flotilla_kv::PoolConfig {
        flotilla_kv::PoolConfig {
            num_blocks: self.num_blocks,
            block_size: self.block_size,
            tenant_blocks_max: self.tenants.iter().map(|t| t.kv_blocks_max).collect(),
            tier_reserved_blocks: self.tiers.iter().map(|t| t.kv_reserved_blocks).collect(),
            offload_blocks: self.offload_blocks,
        }
    }

    /// Blocks one request of `tenant` could ever hold: the pool less other
    /// tiers' reservations, capped by the tenant's quota.
    pub(crate) fn max_blocks_for(&self, tenant: usize) -> u32 {
        let t = &self.tenants[tenant];
        let others_reserved: u64 = self
            .tiers
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != usize::from(t.tier.0))
            .map(|(_, tier)| u64::from(tier.kv_reserved_blocks))
            .sum();
        let pool = u64::from(self.num_blocks).saturating_sub(others_reserved);
        let cap = t.kv_blocks_max.map_or(pool, |q| pool.min(u64::from(q)));
        u32::try_from(cap).unwrap_or(u32::MAX)
    }

    /// Blocks that hold the KV of `tokens` positions.
    pub(crate) fn blocks_for(&self, tokens: usize) -> u64 {
        (tokens as u64).div_ceil(u64::from(self.block_size))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use flotilla_proto::TierId;

    /// A two-tier config (0 = free, priority 0; 1 = paid, priority 10) with
    /// tenants 0,1 free and 2 paid.
    pub(crate) fn two_tiers(num_blocks: u32, block_size: u32) -> SchedConfig {
        let tier = |name: &str, weight, priority| TierConfig {
            name: name.into(),
            weight,
            priority,
            queue_len_max: 1000,
            kv_reserved_blocks: 0,
            step_tokens_max: None,
            step_time_max: None,
        };
        let tenant = |name: &str, tier| TenantConfig {
            name: name.into(),
            tier: TierId(tier),
            weight: 1,
            max_concurrent: 0,
            requests_per_minute: None,
            kv_blocks_max: None,
            prefix_salt: 0,
        };
        SchedConfig {
            num_blocks,
            block_size,
            max_num_seqs: 8,
            max_num_batched_tokens: 256,
            max_model_len: 4096,
            batching: Batching::Continuous,
            queue_timeout: Duration::from_secs(60),
            stop_tokens: vec![2],
            tiers: vec![tier("free", 1, 0), tier("paid", 3, 10)],
            tenants: vec![tenant("a", 0), tenant("b", 0), tenant("p", 1)],
            speculation: Speculation::OFF,
            offload_blocks: 0,
            step_time_max: None,
            decode_steps: 1,
        }
    }

    #[test]
    fn validate_refuses_each_bad_field() {
        assert_eq!(two_tiers(64, 16).validate(), Ok(()));
        let mut c = two_tiers(64, 16);
        c.max_num_seqs = 0;
        assert_eq!(
            c.validate(),
            Err(ConfigError::Zero {
                field: "max_num_seqs"
            })
        );
        let mut c = two_tiers(64, 16);
        c.step_time_max = Some(Duration::ZERO);
        assert_eq!(
            c.validate(),
            Err(ConfigError::Zero {
                field: "step_time_max"
            })
        );
        let mut c = two_tiers(64, 16);
        c.tiers[1].step_time_max = Some(Duration::ZERO);
        assert_eq!(
            c.validate(),
            Err(ConfigError::TierField {
                tier: "paid".into(),
                field: "step_time_max"
            })
        );
        let mut c = two_tiers(64, 16);
        c.tiers.clear();
        assert_eq!(c.validate(), Err(ConfigError::TierCount { count: 0 }));
        let mut c = two_tiers(64, 16);
        c.tenants[1].tier = TierId(7);
        assert!(matches!(c.validate(), Err(ConfigError::UnknownTier { .. })));
        let mut c = two_tiers(64, 16);
        c.tenants[1].name = "a".into();
        assert!(matches!(
            c.validate(),
            Err(ConfigError::DuplicateName { .. })
        ));
        let mut c = two_tiers(64, 16);
        c.tiers[0].weight = 0;
        assert!(matches!(c.validate(), Err(ConfigError::TierField { .. })));
        let mut c = two_tiers(64, 16);
        c.tenants[0].requests_per_minute = Some(0);
        assert!(matches!(c.validate(), Err(ConfigError::TenantField { .. })));
        let mut c = two_tiers(64, 16);
        c.speculation = Speculation {
            ngram_min: 3,
            ngram_max: 2,
            ..Speculation::ngram(4)
        };
        assert!(matches!(c.validate(), Err(ConfigError::Speculation(_))));
        c.speculation = Speculation::ngram(256);
        assert!(matches!(c.validate(), Err(ConfigError::Speculation(_))));
        c.speculation = Speculation::ngram(255);
        assert_eq!(c.validate(), Ok(()));
    }

    #[test]
    fn max_blocks_excludes_other_reservations_and_quota() {
        let mut c = two_tiers(64, 16);
        c.tiers[1].kv_reserved_blocks = 10;
        assert_eq!(c.max_blocks_for(0), 54);
        assert_eq!(c.max_blocks_for(2), 64);
        c.tenants[2].kv_blocks_max = Some(5);
        assert_eq!(c.max_blocks_for(2), 5);
        assert_eq!(c.blocks_for(17), 2);
    }
}
