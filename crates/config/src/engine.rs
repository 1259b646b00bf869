//! The engine's settings, built in one place for `flotilla serve`,
//! `flotilla node` and the simulator: a flag over the file's `[engine]`
//! over the caller's default, every number checked here with the flag or
//! key that gave it named, and the tiers and tenants turned into the
//! Scheduler's config ([`ClusterConfig::sched_config`]).

use std::time::Duration;

use flotilla_proto::{KvDtype, TierId};
use flotilla_sched::{Batching, SchedConfig, Speculation, TenantConfig, TierConfig};

use crate::{ClusterConfig, EngineSection, Tenant, check_queue_timeout_s};

/// Ranges of the engine's numbers.
pub const MAX_NUM_SEQS: std::ops::RangeInclusive<usize> = 1..=4096;
/// Tokens one step may compute.
pub const MAX_NUM_BATCHED_TOKENS: std::ops::RangeInclusive<usize> = 1..=16384;
/// Tokens per KV block.
pub const BLOCK_SIZE: std::ops::RangeInclusive<usize> = 1..=1024;
/// Draft tokens per sequence per step.
pub const NUM_SPECULATIVE_TOKENS: std::ops::RangeInclusive<usize> = 1..=64;
/// Layers a self-draft may run (the engine caps it below the model's count).
pub const SPECULATIVE_DRAFT_LAYERS: std::ops::RangeInclusive<usize> = 1..=1024;
/// Decodes in a step up to which speculation runs.
pub const SPECULATIVE_MAX_BATCH: std::ops::RangeInclusive<usize> = 1..=4096;
/// Decode steps one plan may run back to back.
pub const DECODE_STEPS: std::ops::RangeInclusive<usize> = 1..=flotilla_sched::DECODE_STEPS_MAX;

/// What applies where neither a flag nor the file says: a CPU server and
/// a simulated GPU cluster want different batches.
#[derive(Clone, Debug)]
pub struct EngineDefaults {
    /// Sequences in a batch.
    pub max_num_seqs: usize,
    /// Tokens a step computes.
    pub max_num_batched_tokens: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Seconds a request may wait in its queue.
    pub queue_timeout_s: f64,
    /// Speculative decoding where neither a flag nor the file says.
    pub speculation: Speculation,
    /// Step time target, milliseconds, where neither a flag nor the file
    /// says (`None`: chunks fill the token budget).
    pub step_time_max_ms: Option<f64>,
}

impl EngineDefaults {
    /// `flotilla serve` and `flotilla node` on this machine's CPU.
    pub fn serve(block_size: usize) -> EngineDefaults {
        EngineDefaults {
            max_num_seqs: 32,
            max_num_batched_tokens: 512,
            block_size,
            queue_timeout_s: 60.0,
            speculation: Speculation::ngram(DEFAULT_DRAFT),
            step_time_max_ms: None,
        }
    }
}

/// The engine's numbers once resolved and checked.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineSettings {
    /// Sequences in a batch.
    pub max_num_seqs: usize,
    /// Tokens a step computes.
    pub max_num_batched_tokens: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// How long a request may wait in its queue.
    pub queue_timeout: Duration,
    /// Continuous or static batching.
    pub batching: Batching,
    /// Element type of the KV cache.
    pub kv_dtype: KvDtype,
    /// Speculative decoding.
    pub speculation: Speculation,
    /// The draft model's name or path, where `speculation.draft_model`.
    pub draft_model: Option<String>,
    /// The draft model's logits cover the first this many token ids (0:
    /// the whole vocabulary).
    pub draft_vocab: usize,
    /// Bytes of the KV offload tier (0: none).
    pub kv_offload_bytes: u64,
    /// File that holds the offload tier, if not RAM.
    pub kv_offload_path: Option<std::path::PathBuf>,
    /// Longest a step carrying prefill chunks should take (chunks sized
    /// from the measured step cost); `None`: no target.
    pub step_time_max: Option<Duration>,
    /// Most decode steps one plan may run back to back
    /// (`SchedConfig::decode_steps`).
    pub decode_steps: usize,
}

/// Token ids a draft model's logits cover unless told otherwise
/// (`--draft-vocab`): all of them (0). Cut to Qwen2.5's first 32,768 ids,
/// the 0.5B draft's passes were 17% shorter but its guesses for code
/// were accepted less often (62% against 74% of draft tokens), a loss
/// (docs/BENCHMARKS.md).
pub const DEFAULT_DRAFT_VOCAB: usize = 0;

/// Draft tokens per step of `--speculative ngram` unless told otherwise.
pub const DEFAULT_DRAFT: usize = 4;

/// One number: the flag's (`--{name}`), else the file's (`engine.{key}`),
/// else the default; with the name of where it came from for errors.
fn pick<T: Copy>(
    flag: Option<T>,
    file: Option<T>,
    default: T,
    (name, key): (&str, &str),
) -> (T, String) {
    match (flag, file) {
        (Some(v), _) => (v, format!("--{name}")),
        (None, Some(v)) => (v, format!("engine.{key}")),
        (None, None) => (default, format!("the default {key}")),
    }
}

fn in_range(
    (v, from): (usize, String),
    range: std::ops::RangeInclusive<usize>,
) -> Result<usize, String> {
    if range.contains(&v) {
        Ok(v)
    } else {
        Err(format!(
            "{from} {v} must be in {}..={}",
            range.start(),
            range.end()
        ))
    }
}

impl EngineSection {
    /// The settings: each of `flags` (the command line's, as a section)
    /// over this file's over `d`, checked; `batching` is `continuous` or
    /// `static`. An error names the flag or key.
    pub fn resolve(
        &self,
        flags: &EngineSection,
        batching: &str,
        d: &EngineDefaults,
    ) -> Result<EngineSettings, String> {
        let max_num_seqs = in_range(
            pick(
                flags.max_num_seqs,
                self.max_num_seqs,
                d.max_num_seqs,
                ("max-num-seqs", "max_num_seqs"),
            ),
            MAX_NUM_SEQS,
        )?;
        let max_num_batched_tokens = in_range(
            pick(
                flags.max_num_batched_tokens,
                self.max_num_batched_tokens,
                d.max_num_batched_tokens,
                ("max-num-batched-tokens", "max_num_batched_tokens"),
            ),
            MAX_NUM_BATCHED_TOKENS,
        )?;
        let block_size = in_range(
            pick(
                flags.block_size,
                self.block_size,
                d.block_size,
                ("block-size", "block_size"),
            ),
            BLOCK_SIZE,
        )?;
        let decode_steps = in_range(
            pick(
                flags.decode_steps,
                self.decode_steps,
                1,
                ("decode-steps", "decode_steps"),
            ),
            DECODE_STEPS,
        )?;
        let (q, from) = pick(
            flags.queue_timeout_s,
            self.queue_timeout_s,
            d.queue_timeout_s,
            ("queue-timeout", "queue_timeout_s"),
        );
        check_queue_timeout_s(q).map_err(|why| format!("{from} {q} {why}"))?;
        let kv_dtype = match (&flags.kv_cache_dtype, &self.kv_cache_dtype) {
            (Some(d), _) => KvDtype::parse(d).map_err(|why| format!("--kv-cache-dtype: {why}"))?,
            (None, Some(d)) => {
                KvDtype::parse(d).map_err(|why| format!("engine.kv_cache_dtype: {why}"))?
            }
            (None, None) => KvDtype::default(),
        };
        let speculation = self.speculation(flags, d)?;
        let draft_model = match (&flags.draft_model, &self.draft_model) {
            (Some(m), _) | (None, Some(m)) => Some(m.clone()),
            (None, None) => None,
        };
        match (speculation.draft_model, &draft_model) {
            (true, None) => {
                return Err(
                    "--speculative draft needs a draft model: --draft-model NAME|PATH \
                     (engine.draft_model)"
                        .into(),
                );
            }
            (false, Some(m)) => {
                return Err(format!(
                    "--draft-model {m} is for --speculative draft, not {}",
                    if speculation.is_on() {
                        if speculation.self_layers > 0 {
                            "self"
                        } else {
                            "ngram"
                        }
                    } else {
                        "off"
                    }
                ));
            }
            _ => {}
        }
        let (draft_vocab, _) = pick(
            flags.draft_vocab,
            self.draft_vocab,
            DEFAULT_DRAFT_VOCAB,
            ("draft-vocab", "draft_vocab"),
        );
        let (kv_offload_bytes, _) = pick(
            flags.kv_offload_bytes,
            self.kv_offload_bytes,
            0,
            ("kv-offload-bytes", "kv_offload_bytes"),
        );
        let kv_offload_path = match (&flags.kv_offload_path, &self.kv_offload_path) {
            (Some(p), _) | (None, Some(p)) => Some(std::path::PathBuf::from(p)),
            (None, None) => None,
        };
        if kv_offload_path.is_some() && kv_offload_bytes == 0 {
            let from = if flags.kv_offload_path.is_some() {
                "--kv-offload-path"
            } else {
                "engine.kv_offload_path"
            };
            return Err(format!(
                "{from} needs a tier size: set --kv-offload-bytes (engine.kv_offload_bytes)"
            ));
        }
        let step_time_max = match (flags.step_time_max_ms, &self.step_time_max_ms) {
            (Some(ms), _) => Some((ms, "--step-time-max-ms")),
            (None, Some(ms)) => Some((*ms, "engine.step_time_max_ms")),
            (None, None) => d
                .step_time_max_ms
                .map(|ms| (ms, "the default step_time_max_ms")),
        };
        let step_time_max = match step_time_max {
            Some((ms, from)) => {
                crate::check_step_time_ms(ms).map_err(|why| format!("{from} {ms} {why}"))?;
                Some(Duration::from_secs_f64(ms / 1000.0))
            }
            None => None,
        };
        let batching = match batching {
            "continuous" => Batching::Continuous,
            "static" => Batching::Static,
            b => {
                return Err(format!(
                    "unknown batching '{b}' (expected continuous or static)"
                ));
            }
        };
        Ok(EngineSettings {
            max_num_seqs,
            max_num_batched_tokens,
            block_size,
            queue_timeout: Duration::from_secs_f64(q),
            batching,
            kv_dtype,
            speculation,
            draft_model,
            draft_vocab,
            kv_offload_bytes,
            kv_offload_path,
            step_time_max,
            decode_steps,
        })
    }

    /// `--speculative` (`ngram`, `self` or `off`) with its draft length,
    /// batch bound and self-draft depth, each over the file's and the
    /// default.
    fn speculation(
        &self,
        flags: &EngineSection,
        d: &EngineDefaults,
    ) -> Result<Speculation, String> {
        let mode = match (&flags.speculative, &self.speculative) {
            (Some(m), _) => Some((m.as_str(), "--speculative")),
            (None, Some(m)) => Some((m.as_str(), "engine.speculative")),
            // A draft model given alone means speculation with it.
            (None, None) if flags.draft_model.is_some() || self.draft_model.is_some() => {
                Some(("draft", "--draft-model"))
            }
            (None, None) => None,
        };
        let mut spec = match mode {
            None => d.speculation,
            Some(("off", _)) => return Ok(Speculation::OFF),
            Some(("ngram", _)) => Speculation::ngram(DEFAULT_DRAFT),
            Some(("self", _)) => {
                Speculation::self_draft(DEFAULT_DRAFT, flotilla_sched::SELF_LAYERS_DEFAULT)
            }
            Some(("draft", _)) => Speculation::draft_model(DEFAULT_DRAFT),
            Some((other, from)) => {
                return Err(format!(
                    "{from}: unknown speculation '{other}' (expected ngram, self, draft or off)"
                ));
            }
        };
        if !spec.is_on() {
            return Ok(spec);
        }
        spec.max_draft = in_range(
            pick(
                flags.num_speculative_tokens,
                self.num_speculative_tokens,
                spec.max_draft,
                ("num-speculative-tokens", "num_speculative_tokens"),
            ),
            NUM_SPECULATIVE_TOKENS,
        )?;
        spec.max_batch = in_range(
            pick(
                flags.speculative_max_batch,
                self.speculative_max_batch,
                spec.max_batch,
                ("speculative-max-batch", "speculative_max_batch"),
            ),
            SPECULATIVE_MAX_BATCH,
        )?;
        if spec.draft_model {
            let (p, from) = pick(
                flags.draft_p_min,
                self.draft_p_min,
                f64::from(flotilla_sched::DRAFT_P_MIN),
                ("draft-p-min", "draft_p_min"),
            );
            if !(0.0..=1.0).contains(&p) {
                return Err(format!("{from} {p} must be in 0..=1"));
            }
            spec.draft_p_min = p as f32;
        }
        if spec.self_layers > 0 {
            let layers = (
                flags.speculative_draft_layers,
                self.speculative_draft_layers,
            );
            if layers.0.is_some() || layers.1.is_some() {
                spec.self_layers = in_range(
                    pick(
                        layers.0,
                        layers.1,
                        0,
                        ("speculative-draft-layers", "speculative_draft_layers"),
                    ),
                    SPECULATIVE_DRAFT_LAYERS,
                )?;
            }
        }
        Ok(spec)
    }
}

impl Tenant {
    /// Its prefix-cache salt: 0 shares cached prefixes with other
    /// tenants, anything else keeps them apart.
    pub fn prefix_salt(&self) -> u64 {
        if !self.isolate_prefix_cache {
            return 0;
        }
        // FNV-1a: stable across runs and builds, never 0 for a real name.
        let mut h: u64 = 0xcbf29ce484222325;
        for b in self.name.bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
        h.max(1)
    }
}

impl ClusterConfig {
    /// The Scheduler's config: the engine's settings, this config's tiers
    /// and tenants, and what the model and memory decided (its length, the
    /// blocks the cache holds and their size, its stop tokens). The one
    /// place a `SchedConfig` is built outside tests; checked as a whole.
    pub fn sched_config(
        &self,
        s: &EngineSettings,
        max_model_len: usize,
        (num_blocks, bytes_per_block): (u32, u64),
        stop_tokens: Vec<u32>,
    ) -> Result<SchedConfig, String> {
        let offload_blocks = s.kv_offload_bytes / bytes_per_block.max(1);
        if s.kv_offload_bytes > 0 && offload_blocks == 0 {
            return Err(format!(
                "--kv-offload-bytes {} holds no KV block ({bytes_per_block} bytes each)",
                s.kv_offload_bytes
            ));
        }
        let sched = SchedConfig {
            offload_blocks: offload_blocks.min(u64::from(u32::MAX / 2)) as u32,
            num_blocks,
            block_size: s.block_size as u32,
            max_num_seqs: s.max_num_seqs,
            max_num_batched_tokens: s.max_num_batched_tokens,
            max_model_len,
            step_time_max: s.step_time_max,
            decode_steps: s.decode_steps,
            batching: s.batching,
            queue_timeout: s.queue_timeout,
            stop_tokens,
            tiers: self
                .tiers
                .iter()
                .map(|t| TierConfig {
                    name: t.name.clone(),
                    weight: t.weight,
                    priority: t.priority,
                    queue_len_max: t.queue_len_max,
                    kv_reserved_blocks: t.kv_reserved_blocks,
                    step_tokens_max: t.step_tokens_max,
                    step_time_max: t
                        .step_time_max_ms
                        .map(|ms| Duration::from_secs_f64(ms / 1000.0)),
                })
                .collect(),
            tenants: self
                .tenants
                .iter()
                .map(|t| TenantConfig {
                    name: t.name.clone(),
                    tier: TierId(t.tier as u8),
                    weight: t.weight,
                    max_concurrent: t.max_concurrent,
                    requests_per_minute: t.requests_per_minute,
                    kv_blocks_max: t.kv_blocks_max,
                    prefix_salt: t.prefix_salt(),
                })
                .collect(),
            speculation: s.speculation,
        };
        sched.validate().map_err(|e| e.to_string())?;
        Ok(sched)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flag_wins_over_the_file_over_the_default_and_errors_name_their_source() {
        let file = EngineSection {
            max_num_seqs: Some(64),
            max_num_batched_tokens: Some(1024),
            ..EngineSection::default()
        };
        let flags = EngineSection {
            max_num_seqs: Some(8),
            ..EngineSection::default()
        };
        let d = EngineDefaults::serve(16);
        let s = file.resolve(&flags, "continuous", &d).unwrap();
        assert_eq!(
            (s.max_num_seqs, s.max_num_batched_tokens, s.block_size),
            (8, 1024, 16)
        );
        assert_eq!(s.queue_timeout, Duration::from_secs(60));
        let bad = |flags: EngineSection, file: EngineSection, batching: &str| {
            file.resolve(&flags, batching, &d).unwrap_err()
        };
        let none = EngineSection::default;
        let e = bad(
            EngineSection {
                max_num_seqs: Some(0),
                ..none()
            },
            none(),
            "continuous",
        );
        assert_eq!(e, "--max-num-seqs 0 must be in 1..=4096");
        let e = bad(
            none(),
            EngineSection {
                block_size: Some(4096),
                ..none()
            },
            "continuous",
        );
        assert_eq!(e, "engine.block_size 4096 must be in 1..=1024");
        let e = bad(
            EngineSection {
                queue_timeout_s: Some(-1.0),
                ..none()
            },
            none(),
            "continuous",
        );
        assert!(e.starts_with("--queue-timeout -1 must be"), "{e}");
        for q in [0.0, 86_400.5, 1e300, f64::INFINITY, f64::NAN] {
            let flags = EngineSection {
                queue_timeout_s: Some(q),
                ..none()
            };
            let e = bad(flags, none(), "continuous");
            assert!(e.contains("(0, 86400]"), "{q}: {e}");
        }
        let e = bad(none(), none(), "eager");
        assert!(e.contains("unknown batching 'eager'"), "{e}");
    }

    #[test]
    fn the_sched_config_carries_tiers_tenants_and_isolated_salts() {
        let cfg = ClusterConfig::parse(
            r#"
            [[tiers]]
            name = "paid"
            priority = 2
            [[tiers]]
            name = "free"
            [[tenants]]
            name = "acme"
            tier = "paid"
            api_keys = ["acme-key-1"]
            isolate_prefix_cache = true
            [[tenants]]
            name = "anon"
            tier = "free"
            api_keys = ["anon-key-1"]
            "#,
            "test",
        )
        .unwrap();
        let s = EngineSection::default()
            .resolve(
                &EngineSection::default(),
                "static",
                &EngineDefaults::serve(16),
            )
            .unwrap();
        let sc = cfg.sched_config(&s, 2048, (100, 4096), vec![2]).unwrap();
        assert_eq!(sc.batching, Batching::Static);
        assert_eq!(sc.tiers[0].priority, 2);
        assert_eq!(sc.tenants[1].tier, TierId(1));
        assert_ne!(sc.tenants[0].prefix_salt, 0);
        assert_eq!(sc.tenants[1].prefix_salt, 0);
        let isolated = |name: &str| Tenant {
            name: name.into(),
            isolate_prefix_cache: true,
            ..Tenant::open_default(0)
        };
        assert_ne!(isolated("a").prefix_salt(), isolated("b").prefix_salt());
        assert_ne!(isolated("").prefix_salt(), 0);
        // The Scheduler's own check runs: no blocks is refused.
        assert!(cfg.sched_config(&s, 2048, (0, 4096), vec![]).is_err());
    }

    #[test]
    fn a_draft_model_turns_on_draft_speculation_and_draft_needs_one() {
        let d = EngineDefaults::serve(16);
        let resolve = |flags: EngineSection, file: EngineSection| {
            file.resolve(&flags, "continuous", &d)
                .map(|s| (s.speculation, s.draft_model, s.draft_vocab))
        };
        let with = |mode: Option<&str>, model: Option<&str>| EngineSection {
            speculative: mode.map(String::from),
            draft_model: model.map(String::from),
            ..EngineSection::default()
        };
        // A draft model alone means draft speculation, from a flag or the file.
        let (spec, model, vocab) = resolve(
            with(None, Some("qwen2.5-coder-0.5b")),
            EngineSection::default(),
        )
        .unwrap();
        assert_eq!(spec, Speculation::draft_model(DEFAULT_DRAFT));
        assert_eq!(model.as_deref(), Some("qwen2.5-coder-0.5b"));
        assert_eq!(vocab, DEFAULT_DRAFT_VOCAB);
        let (spec, model, _) = resolve(
            EngineSection {
                draft_vocab: Some(32768),
                ..EngineSection::default()
            },
            with(Some("draft"), Some("/models/d.gguf")),
        )
        .unwrap();
        assert!(spec.draft_model && spec.is_on());
        assert_eq!(model.as_deref(), Some("/models/d.gguf"));
        // Draft needs a model; a model is for draft only.
        assert_eq!(
            resolve(with(Some("draft"), None), EngineSection::default()).unwrap_err(),
            "--speculative draft needs a draft model: --draft-model NAME|PATH (engine.draft_model)"
        );
        assert_eq!(
            resolve(
                with(Some("ngram"), Some("d.gguf")),
                EngineSection::default()
            )
            .unwrap_err(),
            "--draft-model d.gguf is for --speculative draft, not ngram"
        );
        assert_eq!(
            resolve(with(Some("off"), Some("d.gguf")), EngineSection::default()).unwrap_err(),
            "--draft-model d.gguf is for --speculative draft, not off"
        );
    }

    #[test]
    fn speculation_from_flag_file_or_default_with_its_source_named() {
        let d = EngineDefaults::serve(16);
        let none = EngineSection::default;
        let resolve = |flags: EngineSection, file: EngineSection| {
            file.resolve(&flags, "continuous", &d)
                .map(|s| s.speculation)
        };
        // The default: n-gram lookup, 4 tokens, at most 2 decoding streams.
        assert_eq!(
            resolve(none(), none()),
            Ok(Speculation::ngram(DEFAULT_DRAFT))
        );
        assert_eq!(Speculation::ngram(DEFAULT_DRAFT).max_batch, 2);
        let file = EngineSection {
            speculative: Some("off".into()),
            ..none()
        };
        assert_eq!(resolve(none(), file.clone()), Ok(Speculation::OFF));
        // The flag wins over the file, and its numbers over both.
        let flags = EngineSection {
            speculative: Some("ngram".into()),
            num_speculative_tokens: Some(6),
            speculative_max_batch: Some(3),
            ..none()
        };
        let s = resolve(flags, file).unwrap();
        assert_eq!((s.max_draft, s.max_batch), (6, 3));
        let e = resolve(
            EngineSection {
                speculative: Some("eagle".into()),
                ..none()
            },
            none(),
        )
        .unwrap_err();
        assert_eq!(
            e,
            "--speculative: unknown speculation 'eagle' (expected ngram, self, draft or off)"
        );
        // A self-draft: three quarters of the model unless told, which the
        // engine resolves; the depth is checked here.
        let self_draft = |layers: Option<usize>| {
            resolve(
                EngineSection {
                    speculative: Some("self".into()),
                    speculative_draft_layers: layers,
                    ..none()
                },
                none(),
            )
        };
        assert_eq!(
            self_draft(None).map(|s| s.self_layers),
            Ok(flotilla_sched::SELF_LAYERS_DEFAULT)
        );
        assert_eq!(self_draft(Some(20)).map(|s| s.self_layers), Ok(20));
        assert_eq!(
            self_draft(Some(0)).unwrap_err(),
            "--speculative-draft-layers 0 must be in 1..=1024"
        );
        assert_eq!(resolve(none(), none()).map(|s| s.self_layers), Ok(0));
        let e = resolve(
            none(),
            EngineSection {
                num_speculative_tokens: Some(0),
                ..none()
            },
        )
        .unwrap_err();
        assert_eq!(e, "engine.num_speculative_tokens 0 must be in 1..=64");
    }

    #[test]
    fn the_step_time_target_comes_from_flag_file_or_default_and_is_checked() {
        let none = EngineSection::default;
        let cfg = ClusterConfig::open();
        let resolve = |flags: EngineSection, file: EngineSection, d: &EngineDefaults| {
            file.resolve(&flags, "continuous", d)
                .map(|s| s.step_time_max)
        };
        let d = EngineDefaults::serve(16);
        assert_eq!(resolve(none(), none(), &d), Ok(None));
        let file = EngineSection {
            step_time_max_ms: Some(80.0),
            ..none()
        };
        let ms = |v: u64| Some(Duration::from_millis(v));
        assert_eq!(resolve(none(), file.clone(), &d), Ok(ms(80)));
        let flags = EngineSection {
            step_time_max_ms: Some(40.0),
            ..none()
        };
        assert_eq!(resolve(flags, file.clone(), &d), Ok(ms(40)));
        let d50 = EngineDefaults {
            step_time_max_ms: Some(50.0),
            ..EngineDefaults::serve(16)
        };
        assert_eq!(resolve(none(), none(), &d50), Ok(ms(50)));
        let e = resolve(
            EngineSection {
                step_time_max_ms: Some(0.0),
                ..none()
            },
            none(),
            &d,
        )
        .unwrap_err();
        assert!(e.starts_with("--step-time-max-ms 0 must be"), "{e}");
        let e = resolve(
            none(),
            EngineSection {
                step_time_max_ms: Some(f64::NAN),
                ..none()
            },
            &d,
        )
        .unwrap_err();
        assert!(e.starts_with("engine.step_time_max_ms NaN must be"), "{e}");
        // Into the scheduler, with a tier's budget in time.
        let s = file.resolve(&none(), "continuous", &d).unwrap();
        let mut cfg = cfg;
        cfg.tiers[0].step_time_max_ms = Some(12.5);
        let sc = cfg.sched_config(&s, 2048, (100, 4096), vec![2]).unwrap();
        assert_eq!(sc.step_time_max, ms(80));
        assert_eq!(
            sc.tiers[0].step_time_max,
            Some(Duration::from_micros(12_500))
        );
    }

    #[test]
    fn the_offload_tier_is_sized_from_flag_or_file_and_checked() {
        let d = EngineDefaults::serve(16);
        let none = EngineSection::default;
        let cfg = ClusterConfig::open();
        // The file's size and path; the flag's size wins.
        let file = EngineSection {
            kv_offload_bytes: Some(10 * 4096),
            kv_offload_path: Some("/var/tmp/tier.bin".into()),
            ..none()
        };
        let s = file.resolve(&none(), "continuous", &d).unwrap();
        assert_eq!(s.kv_offload_bytes, 10 * 4096);
        assert_eq!(
            s.kv_offload_path.as_deref(),
            Some(std::path::Path::new("/var/tmp/tier.bin"))
        );
        let sc = cfg.sched_config(&s, 2048, (100, 4096), vec![2]).unwrap();
        assert_eq!(sc.offload_blocks, 10);
        let flags = EngineSection {
            kv_offload_bytes: Some(3 * 4096 + 100),
            ..none()
        };
        let s = file.resolve(&flags, "continuous", &d).unwrap();
        let sc = cfg.sched_config(&s, 2048, (100, 4096), vec![2]).unwrap();
        assert_eq!(sc.offload_blocks, 3, "whole blocks only");
        // No tier by default.
        let s = none().resolve(&none(), "continuous", &d).unwrap();
        assert_eq!(
            cfg.sched_config(&s, 2048, (100, 4096), vec![])
                .unwrap()
                .offload_blocks,
            0
        );
        // A path without a size, a size that holds no block: errors that
        // name the flag.
        let e = none()
            .resolve(
                &EngineSection {
                    kv_offload_path: Some("tier.bin".into()),
                    ..none()
                },
                "continuous",
                &d,
            )
            .unwrap_err();
        assert!(e.starts_with("--kv-offload-path needs a tier size"), "{e}");
        let s = none()
            .resolve(
                &EngineSection {
                    kv_offload_bytes: Some(4095),
                    ..none()
                },
                "continuous",
                &d,
            )
            .unwrap();
        let e = cfg.sched_config(&s, 2048, (100, 4096), vec![]).unwrap_err();
        assert_eq!(
            e,
            "--kv-offload-bytes 4095 holds no KV block (4096 bytes each)"
        );
    }
}
