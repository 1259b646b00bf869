//! `flotilla serve`: one node with all four roles in one process: the
//! Router's HTTP front, the Scheduler (with its KV block pool) and the
//! GpuWorker, on the default model unless `--model` names another.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use flotilla_actors::{Clock, EngineOptions, spawn_engine};
use flotilla_config::engine::EngineDefaults;
use flotilla_config::{ClusterConfig, EngineSection, check_kv_cache_fraction};
use flotilla_cuda::{CudaConfig, CudaExecutor, Device};
use flotilla_gateway::GatewayConfig;
use flotilla_gguf::GgufFile;
use flotilla_model::arch::ModelConfig;
use flotilla_model::{CpuExecutor, Executor};
use flotilla_sched::SchedConfig;
use flotilla_telemetry::Metrics;
use flotilla_text::TextSide;

use crate::ModelArgs;

/// The config `serve` uses when `--config` is not given and
/// `cluster-configs/single-node.toml` is not under the working directory.
const BUILTIN_CONFIG: &str = include_str!("../../../cluster-configs/single-node.toml");
const DEFAULT_CONFIG_PATH: &str = "cluster-configs/single-node.toml";

/// `flotilla serve` flags; engine flags are named as vLLM names them and
/// override the config file's `[engine]` table.
#[derive(clap::Args, Clone)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Cluster config (tiers, tenants, API keys); default:
    /// cluster-configs/single-node.toml.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Serve without API keys, as one default tenant (ignores the config's tenants).
    #[arg(long)]
    pub no_auth: bool,
    /// Address to listen on (default 127.0.0.1). Any but loopback needs
    /// --config (your own API keys) or --no-auth: the built-in example
    /// keys are public.
    #[arg(long)]
    pub host: Option<String>,
    /// Port to listen on (default 8000).
    #[arg(long)]
    pub port: Option<u16>,
    /// Name the API reports for the model (default: the file name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Longest prompt + completion, tokens (default: the model's context).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Most sequences in one step.
    #[arg(long)]
    pub max_num_seqs: Option<usize>,
    /// Token budget of one step (prefill chunks + decodes).
    #[arg(long)]
    pub max_num_batched_tokens: Option<usize>,
    /// Fraction of memory for the KV cache. CPU (default 0.1): of the
    /// memory cgroup's limit less the weights where one is set (a
    /// container's limit), else of the host's available memory. CUDA
    /// (default 0.9): of the device memory the weights leave.
    #[arg(long)]
    pub kv_cache_fraction: Option<f64>,
    /// KV cache size in bytes (overrides --kv-cache-fraction).
    #[arg(long)]
    pub kv_cache_bytes: Option<u64>,
    /// Seconds a request may wait in the queue before it fails.
    #[arg(long)]
    pub queue_timeout: Option<f64>,
    /// Speculative decoding: `ngram` (draft tokens looked up in the
    /// sequence's own prompt and output, or forced by its output
    /// constraint, verified in the next step; the output is the same token
    /// for token), `self` (the same, and where the lookup finds nothing the
    /// model's own first layers guess the draft: slower than `ngram` on
    /// the models measured so far, see docs/BENCHMARKS.md), `draft` (the
    /// same, and where the lookup finds nothing a small draft model,
    /// --draft-model, guesses) or `off`. Config: `[engine]
    /// speculative`. Default: ngram.
    #[arg(long)]
    pub speculative: Option<String>,
    /// The draft model of `--speculative draft` (given alone, it turns
    /// that on): a known name (fetched on first use) or a GGUF file's path,
    /// sharing the model's vocabulary (Qwen2.5-Coder-0.5B for the 1.5B).
    /// It runs beside the model in the same worker, its KV in the same
    /// blocks (the KV cache's size counts both). How many tokens it drafts
    /// a step follows its measured cost and acceptance, up to
    /// --num-speculative-tokens. Config: `[engine] draft_model`.
    #[arg(long)]
    pub draft_model: Option<String>,
    /// The draft model computes logits for the first this many token ids
    /// only (0, the default: all). A BPE vocabulary's ids come in the
    /// order of its merges, commonest first, so the head reads a fraction
    /// of the bytes for guesses that are still often right (on Qwen2.5's
    /// code at 32768 of 151,936 ids, less often than the time saved paid
    /// for: see docs/BENCHMARKS.md). Config: `[engine] draft_vocab`.
    #[arg(long)]
    pub draft_vocab: Option<usize>,
    /// A draft model's guess that the draft itself gives less than this
    /// probability is not proposed, and that sequence drafts no further
    /// this step (default 0.5; 0: every guess up to the length the cost
    /// sum picks). Config: `[engine] draft_p_min`.
    #[arg(long)]
    pub draft_p_min: Option<f64>,
    /// Most draft tokens per sequence per step (default 4).
    #[arg(long)]
    pub num_speculative_tokens: Option<usize>,
    /// Speculate only in steps with at most this many decodes (default 2:
    /// on a CPU each verify position costs nearly a token's compute, so
    /// beyond a couple of streams the step is no longer bound by reading
    /// the weights).
    #[arg(long)]
    pub speculative_max_batch: Option<usize>,
    /// Layers a `--speculative self` draft runs before the final norm and
    /// head (default: three quarters of the model's; at most all but one).
    /// Config: `[engine] speculative_draft_layers`.
    #[arg(long)]
    pub speculative_draft_layers: Option<usize>,
    /// Bytes of host memory (or of --kv-offload-path) for the KV offload
    /// tier: prefix blocks evicted from the KV cache (a preempted
    /// sequence's among them) spill there and come back on a hit instead
    /// of being recomputed. Config: `[engine] kv_offload_bytes`. Default 0
    /// (no tier).
    #[arg(long)]
    pub kv_offload_bytes: Option<u64>,
    /// Keep the offload tier in this file (mapped into memory; created or
    /// truncated; on local disk) so that it can exceed RAM. Config:
    /// `[engine] kv_offload_path`.
    #[arg(long)]
    pub kv_offload_path: Option<String>,
    /// Longest a step that carries prompt chunks should take, in
    /// milliseconds: the scheduler learns what a step costs on this
    /// machine (a fixed part and a part per token, from the steps it ran)
    /// and shrinks prefill chunks (and draft tokens) so that a long prompt
    /// never holds the running streams' next tokens past this. Decodes
    /// are never cut for it. Config: `[engine] step_time_max_ms`. Default:
    /// none (chunks fill --max-num-batched-tokens).
    #[arg(long)]
    pub step_time_max_ms: Option<f64>,
    /// Most decode steps the scheduler may plan at once when every running
    /// stream is decoding and nothing waits: the worker runs them back to
    /// back (stopping after the step in progress when a request arrives or
    /// leaves), saving the scheduler's work between steps, and the streams
    /// get those tokens together. Streams that use stop token ids,
    /// penalties or output constraints are never in such a plan. Config:
    /// `[engine] decode_steps`. Default: 1 (a plan is one step).
    #[arg(long)]
    pub decode_steps: Option<usize>,
    /// continuous (iteration-level) or static (whole batches, for comparison).
    #[arg(long, default_value = "continuous")]
    pub batching: String,
    /// Largest request body, bytes.
    #[arg(long, default_value_t = 1 << 20)]
    pub max_body_bytes: usize,
    /// Export a trace of each request (HTTP front, queue, prefill chunks,
    /// KV transfer, decode steps) to this OTLP/HTTP receiver (protobuf,
    /// posted to URL/v1/traces), e.g. http://127.0.0.1:4318. Config:
    /// `[telemetry] otlp_endpoint`; else OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
    /// or OTEL_EXPORTER_OTLP_ENDPOINT (with OTEL_EXPORTER_OTLP_HEADERS,
    /// OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER(_ARG)). Default: off.
    #[arg(long)]
    pub otlp_endpoint: Option<String>,
    /// Fraction of requests traced (a client's sampled `traceparent` is
    /// always followed). Config: `[telemetry] otlp_sample_ratio`. Default 1.
    #[arg(long)]
    pub otlp_sample_ratio: Option<f64>,
}

/// The process's trace exporter from flags over `[telemetry]`; `None` when
/// no endpoint is given. `instance` names the process in its spans
/// (`service.instance.id`); `clock` is the one its spans are measured in.
pub fn tracing_from(
    args: &ServeArgs,
    cfg: &ClusterConfig,
    instance: &str,
    clock: &dyn Clock,
) -> Result<Option<flotilla_telemetry::Tracing>> {
    let t = &cfg.telemetry;
    // Flags, then the config, then the standard OTEL_* variables.
    let env = flotilla_telemetry::OtelEnv::from_env()?;
    let ratio = args
        .otlp_sample_ratio
        .or(t.otlp_sample_ratio)
        .or(env.sample_ratio)
        .unwrap_or(1.0);
    let service = env.service_name.as_deref().unwrap_or("flotilla");
    let epoch = std::time::SystemTime::now() - clock.now();
    let tr = match (
        args.otlp_endpoint.as_ref().or(t.otlp_endpoint.as_ref()),
        &env.traces_url,
    ) {
        (Some(endpoint), _) => {
            flotilla_telemetry::Tracing::otlp(endpoint, ratio, service, instance, epoch)?
        }
        (None, Some(url)) => {
            flotilla_telemetry::Tracing::otlp_url(url, ratio, service, instance, epoch)?
        }
        (None, None) => return Ok(None),
    };
    Ok(Some(tr))
}

pub struct MonotonicClock(pub Instant);

impl Clock for MonotonicClock {
    fn now(&self) -> Duration {
        self.0.elapsed()
    }
}

fn load_config(args: &ServeArgs) -> Result<(ClusterConfig, String)> {
    let (mut cfg, origin) = match &args.config {
        Some(p) => (ClusterConfig::load(p)?, p.display().to_string()),
        None if Path::new(DEFAULT_CONFIG_PATH).is_file() => (
            ClusterConfig::load(Path::new(DEFAULT_CONFIG_PATH))?,
            DEFAULT_CONFIG_PATH.to_string(),
        ),
        None => (
            ClusterConfig::parse(BUILTIN_CONFIG, "built-in single-node.toml")?,
            "built-in single-node.toml".to_string(),
        ),
    };
    if args.no_auth {
        let (engine, telemetry) = (cfg.engine.clone(), cfg.telemetry.clone());
        cfg = ClusterConfig::open();
        cfg.engine = engine;
        cfg.telemetry = telemetry;
    }
    Ok((cfg, origin))
}

/// Everything `serve` resolved from flags, config and model, before any
/// thread starts: also used by tests to start a server in-process.
pub struct Resolved {
    pub cluster: Arc<ClusterConfig>,
    pub sched: SchedConfig,
    pub exec: Box<dyn Executor>,
    pub text: TextSide,
    pub model_name: String,
    pub max_model_len: usize,
    pub kv_bytes: u64,
    pub config_origin: String,
    /// File of the KV offload tier (`--kv-offload-path`), if not RAM.
    pub offload_path: Option<std::path::PathBuf>,
    /// The model, its precision and the engine's settings as `GET /config`
    /// shows them.
    pub server_info: serde_json::Value,
    /// The draft model (`--speculative draft`), its KV in the same blocks.
    pub draft: Option<Box<dyn Executor>>,
}

/// The element type that holds most of a model file's weight bytes
/// (its quantisation, e.g. `Q4_1`), with that share.
fn weight_type(g: &GgufFile) -> (String, f64) {
    let mut by: std::collections::BTreeMap<&'static str, u64> = Default::default();
    for t in g.tensors() {
        *by.entry(t.ty.name()).or_default() += t.len as u64;
    }
    let total: u64 = by.values().sum();
    by.into_iter()
        .max_by_key(|&(_, b)| b)
        .map_or(("unknown".into(), 0.0), |(n, b)| {
            (n.to_string(), b as f64 / total.max(1) as f64)
        })
}

/// What the Router needs of the model: its text side and its length, not
/// its weights.
pub struct Front {
    pub cluster: ClusterConfig,
    pub config_origin: String,
    pub text: TextSide,
    pub model_name: String,
    pub max_model_len: usize,
    pub path: PathBuf,
    pub llama: ModelConfig,
    /// The model flags over the config's `[model]` table.
    pub model: ModelArgs,
}

/// Config, tokenizer and model length from flags, config and the model file.
pub fn front(args: &ServeArgs) -> Result<Front> {
    let (cluster, config_origin) = load_config(args)?;
    let e = &cluster.engine;
    let model = args.model.with_config(&cluster.model)?;
    let path = model.path()?;
    let g = GgufFile::open(&path)?;
    let text = TextSide::from_gguf(&g).context("loading the tokenizer")?;
    if let Some(name) = text.chat_builtin {
        eprintln!(
            "note: {} has no chat template; the chat endpoint uses the built-in {name} format",
            path.display()
        );
    }
    let lc = ModelConfig::from_gguf(&g)?;
    let max_model_len = args.max_model_len.or(e.max_model_len).unwrap_or(lc.ctx_len);
    if max_model_len < 2 || max_model_len > lc.ctx_len {
        bail!(
            "--max-model-len {max_model_len} must be in 2..={} (the model's context)",
            lc.ctx_len
        );
    }
    let model_name = args.served_model_name.clone().unwrap_or_else(|| {
        path.file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into())
    });
    Ok(Front {
        cluster,
        config_origin,
        text,
        model_name,
        max_model_len,
        path,
        llama: lc,
        model,
    })
}

pub fn resolve(args: &ServeArgs) -> Result<Resolved> {
    resolve_with(args, None, true)
}

/// [`resolve`], for a pipeline group's stage 0 where `pipeline` is given:
/// the executor is the group's (this node's part and links to the later
/// stages). `hold_draft`: load the draft model where the settings name one
/// (a node that only prefills never drafts, and holds none).
pub fn resolve_with(
    args: &ServeArgs,
    pipeline: Option<&crate::stage::PipelinePlan>,
    hold_draft: bool,
) -> Result<Resolved> {
    let Front {
        cluster,
        config_origin,
        text,
        model_name,
        max_model_len,
        path,
        llama: lc,
        model: margs,
    } = front(args)?;
    let g = GgufFile::open(&path)?;
    let e = &cluster.engine;
    // The file's block size wins over the flag's default.
    let flags = EngineSection {
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        block_size: e.block_size.is_none().then_some(margs.block_size),
        kv_cache_dtype: margs.kv_cache_dtype.clone(),
        queue_timeout_s: args.queue_timeout,
        speculative: args.speculative.clone(),
        draft_model: args.draft_model.clone(),
        draft_vocab: args.draft_vocab,
        draft_p_min: args.draft_p_min,
        num_speculative_tokens: args.num_speculative_tokens,
        speculative_max_batch: args.speculative_max_batch,
        speculative_draft_layers: args.speculative_draft_layers,
        kv_offload_bytes: args.kv_offload_bytes,
        kv_offload_path: args.kv_offload_path.clone(),
        step_time_max_ms: args.step_time_max_ms,
        decode_steps: args.decode_steps,
        ..EngineSection::default()
    };
    let settings = e
        .resolve(
            &flags,
            &args.batching,
            &EngineDefaults::serve(margs.block_size),
        )
        .map_err(|m| anyhow::anyhow!(m))?;
    let (max_num_seqs, max_num_batched_tokens, block_size) = (
        settings.max_num_seqs,
        settings.max_num_batched_tokens,
        settings.block_size,
    );
    let mut model_args = margs.clone();
    model_args.block_size = block_size;
    model_args.kv_cache_dtype = Some(settings.kv_dtype.name().to_string());
    let kv_dtype = settings.kv_dtype;
    kv_dtype
        .check_head_dim(lc.head_dim)
        .map_err(anyhow::Error::msg)?;
    let bytes_per_block =
        kv_dtype.bytes_per_block(lc.n_layer, lc.n_head_kv, lc.head_dim, block_size) as u64;
    // The draft model's KV shares the model's blocks: a block's bytes are
    // both halves.
    let draft = match settings.draft_model.as_deref().filter(|_| hold_draft) {
        Some(name) => {
            if margs.device() != Device::Cpu || pipeline.is_some() {
                bail!(
                    "--speculative draft runs on one node's CPU backend (--device cpu, no pipeline group)"
                );
            }
            let p = crate::resolve_model(Some(Path::new(name)))
                .map_err(|e| anyhow::anyhow!("--draft-model: {e:#}"))?;
            let dg =
                GgufFile::open(&p).with_context(|| format!("--draft-model {}", p.display()))?;
            let dc = ModelConfig::from_gguf(&dg)
                .with_context(|| format!("--draft-model {}", p.display()))?;
            if dc.vocab != lc.vocab {
                bail!(
                    "--draft-model {}: its vocabulary ({} tokens) differs from the model's ({} \
                     tokens); a draft model must share the model's tokenizer",
                    p.display(),
                    dc.vocab,
                    lc.vocab
                );
            }
            kv_dtype
                .check_head_dim(dc.head_dim)
                .map_err(|why| anyhow::anyhow!("--draft-model: {why}"))?;
            let bpb =
                kv_dtype.bytes_per_block(dc.n_layer, dc.n_head_kv, dc.head_dim, block_size) as u64;
            Some((p, dg, dc, bpb))
        }
        None => None,
    };
    let draft_bpb = draft.as_ref().map_or(0, |d| d.3);
    let target_bpb = bytes_per_block;
    let bytes_per_block = bytes_per_block + draft_bpb;
    // The memory a fraction is of: the memory cgroup's limit less the
    // weights (the file's tensor bytes) where a limit is set, else the
    // host's available memory (`/ready` shows which).
    let weights: u64 = g.tensors().iter().map(|t| t.len as u64).sum();
    let budget = crate::memory::MemoryBudget::detect(weights);
    let (kv_bytes, memory) = match args.kv_cache_bytes.or(e.kv_cache_bytes) {
        Some(b) => (
            b,
            budget.map_or_else(
                |why| serde_json::json!({ "source": "--kv-cache-bytes", "note": why }),
                |m| m.to_json(),
            ),
        ),
        None => {
            let f = args
                .kv_cache_fraction
                .or(e.kv_cache_fraction)
                .unwrap_or(0.1);
            check_kv_cache_fraction(f)
                .map_err(|why| anyhow::anyhow!("--kv-cache-fraction {f} {why}"))?;
            let m = budget.map_err(|why| anyhow::anyhow!("sizing the KV cache: {why}"))?;
            let mut j = m.to_json();
            j["kv_cache_fraction"] = serde_json::json!(f);
            ((m.bytes as f64 * f) as u64, j)
        }
    };
    let num_blocks = kv_bytes / bytes_per_block;
    let one_seq = max_model_len.div_ceil(block_size) as u64;
    if num_blocks < one_seq && margs.device() == Device::Cpu {
        bail!(
            "a KV cache of {kv_bytes} bytes holds {num_blocks} blocks of {block_size} tokens \
             ({bytes_per_block} bytes each); one sequence of --max-model-len {max_model_len} needs \
             {one_seq}: raise --kv-cache-bytes / --kv-cache-fraction or lower --max-model-len"
        );
    }
    let num_blocks = num_blocks.min(u32::MAX as u64 / 2) as u32;
    let mut pipeline_info = None;
    if pipeline.is_some() && margs.device() != Device::Cpu {
        bail!("pipeline groups run on the CPU backend (--device cpu)");
    }
    let (exec, num_blocks, bytes_per_block): (Box<dyn Executor>, u32, u64) = match margs.device() {
        Device::Cpu => {
            let cpu = model_args.cpu_config(num_blocks as usize, max_num_batched_tokens)?;
            if let Some(p) = pipeline {
                let exec = crate::stage::pipeline_executor(&g, &path, &cpu, p)
                    .context("forming the pipeline group")?;
                pipeline_info = Some(serde_json::json!({
                    "stages": exec.stage_layers().iter()
                        .map(|l| format!("{}..{}", l.start, l.end)).collect::<Vec<_>>(),
                    "activations": exec.dtype().name(),
                }));
                (Box::new(exec), num_blocks, bytes_per_block)
            } else {
                let exec = crate::alloc::loading(|| CpuExecutor::from_gguf(&g, &cpu))
                    .context("loading the model")?;
                if let Some(note) = exec.load_note() {
                    tracing::info!("{note}");
                }
                debug_assert_eq!(exec.kv_spec().bytes_per_block as u64, target_bpb);
                (Box::new(exec), num_blocks, bytes_per_block)
            }
        }
        Device::Cuda(ordinal) => {
            // The device's own memory, not the host's: --kv-cache-bytes
            // does not apply, the fraction is of what the weights leave.
            let f = args
                .kv_cache_fraction
                .or(e.kv_cache_fraction)
                .unwrap_or(0.9);
            check_kv_cache_fraction(f)
                .map_err(|why| anyhow::anyhow!("--kv-cache-fraction {f} {why}"))?;
            let c = CudaConfig {
                ordinal,
                block_size,
                kv_dtype,
                kv_cache_fraction: f,
                max_batch_tokens: max_num_batched_tokens,
                max_seqs: max_num_seqs,
            };
            let exec = CudaExecutor::from_gguf(&g, &c).context("loading the model")?;
            let kv = exec.kv_spec();
            if (kv.num_blocks as u64) < one_seq {
                bail!(
                    "the GPU's KV cache holds {} blocks of {block_size} tokens; one sequence \
                         of --max-model-len {max_model_len} needs {one_seq}: lower --max-model-len",
                    kv.num_blocks
                );
            }
            let n = kv.num_blocks.min(u32::MAX as usize / 2) as u32;
            (Box::new(exec), n, kv.bytes_per_block as u64)
        }
    };
    let draft_exec: Option<Box<dyn Executor>> = match &draft {
        Some((p, dg, _, _)) => {
            let mut cpu = model_args.cpu_config(num_blocks as usize, max_num_batched_tokens)?;
            cpu.head_rows = settings.draft_vocab;
            let exec = crate::alloc::loading(|| CpuExecutor::from_gguf(dg, &cpu))
                .with_context(|| format!("loading the draft model {}", p.display()))?;
            Some(Box::new(exec))
        }
        None => None,
    };
    let sched = cluster
        .sched_config(
            &settings,
            max_model_len,
            (num_blocks, bytes_per_block),
            text.stop_tokens.clone(),
        )
        .map_err(|m| anyhow::anyhow!("the engine's settings: {m}"))?;
    let (weights, share) = weight_type(&g);
    let server_info = serde_json::json!({
        "server": "flotilla",
        "version": env!("CARGO_PKG_VERSION"),
        "model": model_name,
        "model_file": path.file_name().map(|f| f.to_string_lossy().into_owned()),
        "architecture": lc.describe(),
        "quantization": weights,
        "quantization_share": (share * 1000.0).round() / 1000.0,
        "device": format!("{:?}", margs.device()).to_lowercase(),
        "kernel": margs.kernel_name(),
        "threads": margs.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
        "kv_cache_dtype": kv_dtype.name(),
        "kv_cache_blocks": num_blocks,
        "kv_cache_bytes": num_blocks as u64 * bytes_per_block,
        "block_size": block_size,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "batching": args.batching,
        "speculative": match settings.speculation {
            s if !s.is_on() => "off",
            s if s.self_layers > 0 => "self",
            s if s.draft_model => "draft",
            _ => "ngram",
        },
        "draft_model": draft.as_ref().map(|(p, _, dc, bpb)| serde_json::json!({
            "file": p.file_name().map(|f| f.to_string_lossy().into_owned()),
            "architecture": dc.describe(),
            "kv_bytes_per_block": bpb,
            "vocab": if settings.draft_vocab == 0 { dc.vocab } else { settings.draft_vocab.next_multiple_of(8).min(dc.vocab) },
        })),
        "num_speculative_tokens": settings.speculation.max_draft,
        "draft_p_min": settings.speculation.draft_model.then_some(settings.speculation.draft_p_min),
        "speculative_max_batch": settings.speculation.max_batch,
        "kv_offload_bytes": settings.kv_offload_bytes,
        "queue_timeout_s": settings.queue_timeout.as_secs_f64(),
        "step_time_max_ms": settings.step_time_max.map(|d| d.as_secs_f64() * 1000.0),
        "memory": memory,
        "pipeline": pipeline_info,
    });
    Ok(Resolved {
        server_info,
        cluster: Arc::new(cluster),
        sched,
        exec,
        text,
        model_name,
        max_model_len,
        kv_bytes: num_blocks as u64 * bytes_per_block,
        config_origin,
        offload_path: settings.kv_offload_path.clone(),
        draft: draft_exec,
    })
}

/// Without `--config` the server takes the example config, whose API keys
/// are published in this repository: fine on loopback, an open door on any
/// other address. There it starts only with a config of the operator's
/// own keys or with `--no-auth` (openly, on purpose). Checked before the
/// model loads.
fn refuse_example_keys_off_loopback(args: &ServeArgs, addr: SocketAddr) -> Result<()> {
    if args.config.is_none() && !args.no_auth && !addr.ip().is_loopback() {
        bail!(
            "serve --host {}: without --config the example config's API keys, published in \
             this repository, would guard an address other machines can reach; give a config \
             with your own keys (--config FILE) or serve without keys on purpose (--no-auth)",
            addr.ip()
        );
    }
    Ok(())
}

pub fn run(args: ServeArgs) -> Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_from_env("FLOTILLA_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour only on a terminal: `flotilla cluster` sends each node's
        // stderr to a log file, where escape codes are noise.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    // An IPv4 or IPv6 address, bracketed or not.
    let host = args.host.as_deref().unwrap_or("127.0.0.1");
    let ip: std::net::IpAddr = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse()
        .with_context(|| {
            format!("--host {host} is not an IP address (e.g. 127.0.0.1, 0.0.0.0, ::1)")
        })?;
    let addr = SocketAddr::new(ip, args.port.unwrap_or(8000));
    refuse_example_keys_off_loopback(&args, addr)?;
    let r = resolve(&args)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock(Instant::now()));
    let tracing = tracing_from(&args, &r.cluster, "serve", clock.as_ref())?;
    let served = rt.block_on(serve(r, addr, args.max_body_bytes, clock, tracing.clone()));
    if let Some(t) = tracing {
        t.shutdown();
    }
    served
}

async fn serve(
    r: Resolved,
    addr: SocketAddr,
    max_body_bytes: usize,
    clock: Arc<dyn Clock>,
    tracing: Option<flotilla_telemetry::Tracing>,
) -> Result<()> {
    let metrics = Arc::new(Metrics::new()?);
    let num_blocks = r.sched.num_blocks;
    let tiers: Vec<String> = r.sched.tiers.iter().map(|t| t.name.clone()).collect();
    let kv_dtype = r.exec.kv_spec().dtype;
    let exec: Box<dyn Executor> = r.exec;
    let constraints = flotilla_grammar::compiler_for(&r.text)
        .map_err(|e| anyhow::anyhow!("structured output over this tokenizer: {e}"))?;
    let engine = spawn_engine(
        exec,
        EngineOptions {
            sched: r.sched,
            check_invariants: None,
            constraints: Some(constraints.clone()),
            offload_path: r.offload_path.clone(),
            tracing: tracing.clone(),
            draft: r.draft,
        },
        clock,
        metrics.clone(),
    )
    .await
    .context("starting the engine")?;
    let auth = if r.cluster.is_open() {
        "no API keys (open)".to_string()
    } else {
        format!("API keys from {}", r.config_origin)
    };
    let what = format!(
        "tiers: {}; KV cache {} {} blocks, {} MiB; {auth}",
        tiers.join(", "),
        num_blocks,
        kv_dtype,
        r.kv_bytes >> 20,
    );
    let gw = GatewayConfig {
        model_name: r.model_name.clone(),
        max_model_len: r.max_model_len,
        body_limit_bytes: max_body_bytes,
        cluster: r.cluster.clone(),
        constraints: Some(constraints.clone()),
        tracing,
        server_info: r.server_info.clone(),
        limits_share: (0, 1),
    };
    serve_http(Arc::new(engine.clone()), r.text, metrics, gw, addr, &what).await?;
    engine.stop();
    Ok(())
}

/// Serves the OpenAI API over `engine` at `addr` until Ctrl-C, after one
/// line that names the URL (scripts and tests wait for it).
pub async fn serve_http(
    engine: Arc<dyn flotilla_engine::Engine>,
    text: TextSide,
    metrics: Arc<Metrics>,
    gw: GatewayConfig,
    addr: SocketAddr,
    what: &str,
) -> Result<()> {
    let model_name = gw.model_name.clone();
    let app = flotilla_gateway::router(engine, Arc::new(text), metrics, gw);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    let local = listener.local_addr()?;
    eprintln!("flotilla: serving {model_name} at http://{local}/v1 ({what})");
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
        .context("serving HTTP")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_config_is_the_shipped_one_and_parses() {
        let c = ClusterConfig::parse(BUILTIN_CONFIG, "builtin").unwrap();
        assert!(!c.is_open());
        assert_eq!(c.tiers.len(), 2);
    }
}
