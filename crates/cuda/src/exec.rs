//! The CUDA executor: one forward pass for every architecture that
//! [`flotilla_model::arch::ModelConfig`] describes (Llama, Mistral, Qwen2,
//! Gemma 3), over a flat mixed batch and a paged f16 or int8 KV cache in device
//! memory, computing what the CPU backend (`flotilla_model::cpu`) computes.
//!
//! Per layer, from the description's pieces:
//! - RMSNorm (the previous block's residual add fused in front), then one
//!   GEMM for Q, K and V (`n_head * head_dim + 2 * n_head_kv * head_dim`
//!   rows; the query width need not equal `n_embd`);
//! - `rope_qk`: Q/K/V biases (`qkv_bias`), per-head RMSNorm of Q and K
//!   (`qk_norm`) and RoPE (normal or NEOX pairs; the layer's base; the
//!   frequency factors of Llama 3), with RoPE's inverse frequencies
//!   computed on the host in f64 by [`flotilla_model::arch::inv_freq`], as
//!   on the CPU;
//! - K and V into the cache, then paged attention with the layer's sliding
//!   window (only the blocks inside it are read) and the model's
//!   `attn_scale`;
//! - the output projection (`n_embd x q_dim`) and the residual add:
//!   `x += y`, or `x += rmsnorm(y) * w` with `post_norms` (Gemma), fused
//!   into the next RMSNorm either way;
//! - the gated FFN with SiLU (SwiGLU) or tanh-GELU (GeGLU).
//!
//! The token embedding is scaled by `embd_scale`; the head is separate or
//! tied to the embedding.
//!
//! Weights: every matrix is dequantised to f16 once, at load (Q8_0, Q4_0
//! and Q4_1 on the device by `kernels/dequant.cu`; other GGUF types, Q5_0,
//! Q4_K and Q6_K among them, on the host by
//! [`flotilla_model::quant::dequantize`]), and multiplied by cuBLAS
//! (`cublasGemmEx`, f16 inputs, f32 accumulation and output); norm
//! weights, biases and RoPE factors stay f32. Twice the bytes of Q8_0 per
//! decode step, in exchange for one GEMM path that serves prefill and
//! decode alike; a dequantising GEMV for decode is the next step for
//! bandwidth.
//!
//! One stream; a step queues its kernels and GEMMs without a host sync
//! until the sampled rows' logits are read back. Device buffers are sized
//! at load for `max_batch_tokens`; a step allocates nothing on the device.
//! Kernels take raw device addresses: every buffer lives as long as the
//! executor, and event tracking is off (one stream orders everything).

use std::path::Path;
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig,
    PinnedHostSlice, PushKernelArg,
};
use flotilla_gguf::{GgmlType, GgufError, GgufFile};
use flotilla_model::arch::{self, Activation, ModelConfig, RopeStyle};
use flotilla_model::sampling::{Sampled, SamplerScratch, sample};
use flotilla_model::{
    BatchLimits, ExecError, Executor, KvDtype, KvSpec, ModelSpec, OutputKind, SeqInput, SeqOutput,
    StepOutputs, sample_outputs, validate_batch,
};

use crate::kernels::{self, CompileError, SOURCES};

/// How to build a CUDA executor.
#[derive(Clone, Debug)]
pub struct CudaConfig {
    /// Device ordinal (`--device cuda:N`).
    pub ordinal: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV cache element type: f16 or int8 (f32 is CPU-only).
    pub kv_dtype: KvDtype,
    /// Share of the device memory free after weights and buffers that the
    /// KV cache takes.
    pub kv_cache_fraction: f64,
    /// Most tokens in one step.
    pub max_batch_tokens: usize,
    /// Most sequences in one step.
    pub max_seqs: usize,
}

impl Default for CudaConfig {
    fn default() -> Self {
        CudaConfig {
            ordinal: 0,
            block_size: 16,
            kv_dtype: KvDtype::F16,
            kv_cache_fraction: 0.9,
            max_batch_tokens: 2048,
            max_seqs: 256,
        }
    }
}

/// Why a CUDA executor could not be built.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No CUDA driver on this machine.
    #[error(
        "no CUDA driver: libcuda.so was not found (install the NVIDIA driver, or use --device cpu)"
    )]
    NoDriver,
    /// The ordinal names no device.
    #[error("no CUDA device {ordinal}: this machine has {count}")]
    NoDevice {
        /// Asked for.
        ordinal: usize,
        /// Present.
        count: usize,
    },
    /// A compute capability with no known NVRTC target.
    #[error("CUDA device of compute capability {0}.{1} is not supported")]
    Arch(i32, i32),
    /// cuBLAS is not installed.
    #[error(
        "cuBLAS (libcublas.so) was not found: install the CUDA toolkit or \
         `pip install nvidia-cublas-cu12` and add its lib directory to LD_LIBRARY_PATH"
    )]
    NoCublas,
    /// A kernel did not compile.
    #[error(transparent)]
    Compile(#[from] CompileError),
    /// The model file.
    #[error(transparent)]
    Model(#[from] GgufError),
    /// The model and its buffers do not fit.
    #[error(
        "the model needs {need_mib} MiB of device memory for weights and step buffers; \
         {free_mib} MiB are free on device {ordinal}"
    )]
    DoesNotFit {
        /// Needed.
        need_mib: usize,
        /// Free.
        free_mib: usize,
        /// Device.
        ordinal: usize,
    },
    /// A value out of range.
    #[error("invalid CUDA executor configuration: {0}")]
    Config(String),
    /// The driver or cuBLAS failed.
    #[error("CUDA: {0}")]
    Driver(String),
}

fn drv(e: impl std::fmt::Display) -> CudaError {
    CudaError::Driver(e.to_string())
}

fn exec_err(e: impl std::fmt::Display) -> ExecError {
    ExecError::Backend(format!("CUDA: {e}"))
}

/// Whether the CUDA driver library can be loaded.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library by its usual names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Checks that a CUDA driver and device `ordinal` are present, without the
/// panic cudarc gives when libcuda is missing.
pub fn probe(ordinal: usize) -> Result<Arc<CudaContext>, CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    let count = CudaContext::device_count().map_err(drv)? as usize;
    if ordinal >= count {
        return Err(CudaError::NoDevice { ordinal, count });
    }
    CudaContext::new(ordinal).map_err(drv)
}

struct LayerW {
    attn_norm: CudaSlice<f32>,
    /// Q, K and V rows stacked: `[qkv_w][n_embd]`, `qkv_w = q_dim + 2 * kv_dim`.
    wqkv: CudaSlice<u16>,
    /// Q, K and V biases laid out as a QKV row (`qkv_w` floats).
    bias: Option<CudaSlice<f32>>,
    /// Per-head RMSNorm weights of Q and K (`head_dim` each).
    qk_norm: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
    /// `[n_embd][q_dim]`.
    wo: CudaSlice<u16>,
    /// RMSNorm of the attention output before its residual add.
    post_attn_norm: Option<CudaSlice<f32>>,
    ffn_norm: CudaSlice<f32>,
    w_gate: CudaSlice<u16>,
    w_up: CudaSlice<u16>,
    w_down: CudaSlice<u16>,
    /// RMSNorm of the FFN output before its residual add.
    post_ffn_norm: Option<CudaSlice<f32>>,
}

struct Funcs {
    rms_norm_residual: CudaFunction,
    rope_qk: CudaFunction,
    kv_append: CudaFunction,
    kv_append_q8: CudaFunction,
    copy_block: CudaFunction,
    hadamard_rows: CudaFunction,
    paged_attention: CudaFunction,
    paged_attention_q8: CudaFunction,
    swiglu: CudaFunction,
    geglu: CudaFunction,
    embed: CudaFunction,
    f32_to_f16: CudaFunction,
    add_rows: CudaFunction,
    gather_rows: CudaFunction,
    dequant_q8_0: CudaFunction,
    dequant_q4_0: CudaFunction,
    dequant_q4_1: CudaFunction,
    bf16_to_f16: CudaFunction,
    argmax_rows: CudaFunction,
}

/// Per-step device buffers, sized for `max_batch_tokens` / `max_seqs`.
struct Bufs {
    x: CudaSlice<f32>,
    delta: CudaSlice<f32>,
    /// f16 matmul input, `[tokens][max(n_embd, q_dim, n_ff)]`.
    h16: CudaSlice<u16>,
    qkv: CudaSlice<f32>,
    att: CudaSlice<f32>,
    gate: CudaSlice<f32>,
    up: CudaSlice<f32>,
    /// Rows that want logits, gathered, and their f16 normalised form.
    xs: CudaSlice<f32>,
    hs16: CudaSlice<u16>,
    logits: CudaSlice<f32>,
    /// Greedy picks made on the device: token and logit per row.
    picks: CudaSlice<u32>,
    pick_vals: CudaSlice<f32>,
    tokens: CudaSlice<u32>,
    tok_seq: CudaSlice<i32>,
    tok_pos: CudaSlice<i32>,
    rows: CudaSlice<i32>,
    tables: CudaSlice<i32>,
}

/// Host-side staging of one step's batch description.
#[derive(Default)]
struct Host {
    tokens: Vec<u32>,
    tok_seq: Vec<i32>,
    tok_pos: Vec<i32>,
    rows: Vec<i32>,
    tables: Vec<i32>,
    slots: Vec<usize>,
    picks: Vec<u32>,
}

/// A model of any [`ModelConfig`] architecture on one CUDA device.
pub struct CudaExecutor {
    cfg: ModelConfig,
    spec: ModelSpec,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    f: Funcs,
    tok_embd: CudaSlice<u16>,
    head: Option<CudaSlice<u16>>,
    out_norm: CudaSlice<f32>,
    layers: Vec<LayerW>,
    /// RoPE's inverse frequencies, `[base][head_dim / 2]` (f64), one row
    /// per entry of `cfg.rope_bases`, frequency factors applied.
    inv_freq: CudaSlice<f64>,
    /// The paged cache as bytes (f16 values or int8 runs with their
    /// scales, kernels/kv.cu).
    kv: CudaSlice<u8>,
    kv_dtype: KvDtype,
    bytes_per_block: usize,
    num_blocks: usize,
    block_size: usize,
    max_blocks: usize,
    max_tokens: usize,
    max_seqs: usize,
    /// Output rows one step may have (logits, picks): sequences plus
    /// verified draft positions.
    max_rows: usize,
    b: Bufs,
    host: Host,
    sampler: SamplerScratch,
    /// The KV offload tier in page-locked host memory (`attach_offload`),
    /// with its base pointer: blocks move by asynchronous copies on the
    /// step's stream, so a spill is ordered before any later kernel that
    /// overwrites its block and a restore before the step that reads its
    /// block, and the host never reads or writes these bytes itself.
    offload: Option<(PinnedHostSlice<u8>, *mut u8, u32)>,
}

// SAFETY: the executor is used by one thread at a time (the GpuWorker
// owns it); cudarc's handles are tied to the context, not the thread, and
// every call binds the context first.
unsafe impl Send for CudaExecutor {}

impl std::fmt::Debug for CudaExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaExecutor({} on cuda:{}, {} KV blocks)",
            self.spec.name,
            self.ctx.ordinal(),
            self.num_blocks
        )
    }
}

/// Grid-stride launch for `n` elements.
fn flat(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 65_535) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn rows(n: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn ptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}

/// The address of an optional buffer; null (0) when absent, which the
/// kernels read as "this piece is off".
fn opt_ptr<T>(s: Option<&CudaSlice<T>>, stream: &CudaStream) -> u64 {
    s.map_or(0, |s| ptr(s, stream))
}

impl CudaExecutor {
    /// Loads a GGUF model onto device `c.ordinal`.
    pub fn load(path: &Path, c: &CudaConfig) -> Result<CudaExecutor, CudaError> {
        let g = GgufFile::open(path)?;
        CudaExecutor::from_gguf(&g, c)
    }

    /// Builds the executor from an open GGUF file.
    pub fn from_gguf(g: &GgufFile, c: &CudaConfig) -> Result<CudaExecutor, CudaError> {
        if c.block_size == 0 || c.max_batch_tokens == 0 || c.max_seqs == 0 {
            return Err(CudaError::Config(
                "block size, batch tokens and sequences must be positive".into(),
            ));
        }
        if !(c.kv_cache_fraction > 0.0 && c.kv_cache_fraction <= 1.0) {
            return Err(CudaError::Config(format!(
                "KV cache fraction {} is not in (0, 1]",
                c.kv_cache_fraction
            )));
        }
        let cfg = ModelConfig::from_gguf(g)?;
        if cfg.head_dim > 256 || cfg.head_dim % 2 != 0 {
            return Err(CudaError::Config(format!(
                "head dimension {} (the attention kernel takes even sizes up to 256)",
                cfg.head_dim
            )));
        }
        match c.kv_dtype {
            KvDtype::F16 | KvDtype::Int8 => c
                .kv_dtype
                .check_head_dim(cfg.head_dim)
                .map_err(CudaError::Config)?,
            KvDtype::F32 => {
                return Err(CudaError::Config(
                    "KV cache dtype f32 runs on the CPU only; use f16 or int8 on CUDA".into(),
                ));
            }
        }
        let ctx = probe(c.ordinal)?;
        let (major, minor) = ctx.compute_capability().map_err(drv)?;
        let arch = kernels::arch_name(major, minor).ok_or(CudaError::Arch(major, minor))?;
        let stream = ctx.default_stream();
        // SAFETY: one stream orders every use of every buffer.
        unsafe { ctx.disable_event_tracking() };
        let mut module_fns = std::collections::HashMap::new();
        for src in SOURCES {
            let ptx = kernels::compile(src, arch)?;
            let module = ctx.load_module(ptx).map_err(drv)?;
            for &k in src.kernels {
                module_fns.insert(k, module.load_function(k).map_err(drv)?);
            }
        }
        let mut take = |k: &str| {
            module_fns
                .remove(k)
                .ok_or_else(|| CudaError::Driver(format!("kernel {k} not loaded")))
        };
        let f = Funcs {
            rms_norm_residual: take("rms_norm_residual")?,
            rope_qk: take("rope_qk")?,
            kv_append: take("kv_append")?,
            kv_append_q8: take("kv_append_q8")?,
            copy_block: take("copy_block")?,
            hadamard_rows: take("hadamard_rows")?,
            paged_attention: take("paged_attention")?,
            paged_attention_q8: take("paged_attention_q8")?,
            swiglu: take("swiglu")?,
            geglu: take("geglu")?,
            embed: take("embed")?,
            f32_to_f16: take("f32_to_f16")?,
            add_rows: take("add_rows")?,
            gather_rows: take("gather_rows")?,
            dequant_q8_0: take("dequant_q8_0")?,
            dequant_q4_0: take("dequant_q4_0")?,
            dequant_q4_1: take("dequant_q4_1")?,
            bf16_to_f16: take("bf16_to_f16")?,
            argmax_rows: take("argmax_rows")?,
        };
        // SAFETY: only tries to dlopen the library by its usual names.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(CudaError::NoCublas);
        }
        let blas = CudaBlas::new(stream.clone()).map_err(drv)?;

        let (d, qd, kvd, ff, vocab) = (cfg.n_embd, cfg.q_dim(), cfg.kv_dim(), cfg.n_ff, cfg.vocab);
        let (hd, half) = (cfg.head_dim, cfg.head_dim / 2);
        let qkv_w = qd + 2 * kvd;
        let t = c.max_batch_tokens;
        let s = c.max_seqs.min(t);
        // Output rows: one per sequence, and as many again for the draft
        // positions a step verifies (speculative decoding); every row is an
        // input position, so never more than the step's tokens.
        let o = (2 * s).min(t);
        let max_blocks = cfg.ctx_len.div_ceil(c.block_size);
        // Weights and buffers first, then check what is left.
        let weight_elems = vocab * d
            + cfg.n_layer * (qkv_w * d + d * qd + 2 * ff * d + d * ff)
            + if cfg.separate_head { vocab * d } else { 0 };
        // f32 vectors: norms, biases, QK-norms; and the f64 RoPE table.
        let vector_bytes = 4
            * (d + cfg.n_layer
                * (2 * d
                    + if cfg.post_norms { 2 * d } else { 0 }
                    + if cfg.qkv_bias { qkv_w } else { 0 }
                    + if cfg.qk_norm { 2 * hd } else { 0 }))
            + 8 * cfg.rope_bases.len() * half;
        let buf_bytes = 4 * t * (2 * d + qkv_w + qd + 2 * ff)
            + 2 * t * d.max(qd).max(ff)
            + s * (4 * d + 2 * d + 4 * vocab + 8)
            + 4 * (4 * t + s + s * max_blocks);
        let (free, _) = ctx.mem_get_info().map_err(drv)?;
        let need = weight_elems * 2 + vector_bytes + buf_bytes;
        if need > free {
            return Err(CudaError::DoesNotFit {
                need_mib: need >> 20,
                free_mib: free >> 20,
                ordinal: c.ordinal,
            });
        }

        let mut up = Uploader {
            stream: &stream,
            f: &f,
            g,
        };
        let tok_embd = up.matrix("token_embd.weight", vocab, d)?;
        let head = if cfg.separate_head {
            Some(up.matrix("output.weight", vocab, d)?)
        } else {
            None
        };
        let out_norm = up.vector("output_norm.weight", d)?;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}");
            let bias = if cfg.qkv_bias {
                let mut b = up.host_vector(&n("attn_q.bias"), qd)?;
                b.extend(up.host_vector(&n("attn_k.bias"), kvd)?);
                b.extend(up.host_vector(&n("attn_v.bias"), kvd)?);
                Some(stream.clone_htod(&b).map_err(drv)?)
            } else {
                None
            };
            let qk_norm = if cfg.qk_norm {
                Some((
                    up.vector(&n("attn_q_norm.weight"), hd)?,
                    up.vector(&n("attn_k_norm.weight"), hd)?,
                ))
            } else {
                None
            };
            let mut post = |name: &str| -> Result<Option<CudaSlice<f32>>, CudaError> {
                if cfg.post_norms {
                    Ok(Some(up.vector(&n(name), d)?))
                } else {
                    Ok(None)
                }
            };
            let post_attn_norm = post("post_attention_norm.weight")?;
            let post_ffn_norm = post("post_ffw_norm.weight")?;
            layers.push(LayerW {
                attn_norm: up.vector(&n("attn_norm.weight"), d)?,
                wqkv: up.stacked(
                    &[
                        (&n("attn_q.weight"), qd),
                        (&n("attn_k.weight"), kvd),
                        (&n("attn_v.weight"), kvd),
                    ],
                    d,
                )?,
                bias,
                qk_norm,
                wo: up.matrix(&n("attn_output.weight"), d, qd)?,
                post_attn_norm,
                ffn_norm: up.vector(&n("ffn_norm.weight"), d)?,
                w_gate: up.matrix(&n("ffn_gate.weight"), ff, d)?,
                w_up: up.matrix(&n("ffn_up.weight"), ff, d)?,
                w_down: up.matrix(&n("ffn_down.weight"), d, ff)?,
                post_ffn_norm,
            });
        }
        // RoPE's inverse frequencies, as the CPU backend computes them.
        let factors = if cfg.rope_factors {
            let f = up.host_vector("rope_freqs.weight", half)?;
            if !f.iter().all(|v| v.is_finite() && *v > 0.0) {
                return Err(CudaError::Model(GgufError::Invalid(
                    "rope_freqs.weight holds a factor that is not a positive number".into(),
                )));
            }
            Some(f)
        } else {
            None
        };
        let inv_freq: Vec<f64> = cfg
            .rope_bases
            .iter()
            .flat_map(|&b| arch::inv_freq(b, hd, factors.as_deref()))
            .collect();
        let inv_freq = stream.clone_htod(&inv_freq).map_err(drv)?;
        let z32 = |n: usize| stream.alloc_zeros::<f32>(n.max(1)).map_err(drv);
        let zi = |n: usize| stream.alloc_zeros::<i32>(n.max(1)).map_err(drv);
        let b = Bufs {
            x: z32(t * d)?,
            delta: z32(t * d)?,
            h16: stream
                .alloc_zeros::<u16>(t * d.max(qd).max(ff))
                .map_err(drv)?,
            qkv: z32(t * qkv_w)?,
            att: z32(t * qd)?,
            gate: z32(t * ff)?,
            up: z32(t * ff)?,
            xs: z32(o * d)?,
            hs16: stream.alloc_zeros::<u16>(o * d).map_err(drv)?,
            logits: z32(o * vocab)?,
            picks: stream.alloc_zeros::<u32>(o).map_err(drv)?,
            pick_vals: z32(o)?,
            tokens: stream.alloc_zeros::<u32>(t).map_err(drv)?,
            tok_seq: zi(t)?,
            tok_pos: zi(t)?,
            rows: zi(o)?,
            tables: zi(s * max_blocks)?,
        };

        // KV cache from what is left.
        let bytes_per_block =
            c.kv_dtype
                .bytes_per_block(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, c.block_size);
        let (free, _) = ctx.mem_get_info().map_err(drv)?;
        let kv_bytes = (free as f64 * c.kv_cache_fraction) as usize;
        let num_blocks = (kv_bytes / bytes_per_block).min(i32::MAX as usize);
        if num_blocks < max_blocks.min(64) {
            return Err(CudaError::DoesNotFit {
                need_mib: (need + max_blocks * bytes_per_block) >> 20,
                free_mib: free >> 20,
                ordinal: c.ordinal,
            });
        }
        let kv = stream
            .alloc_zeros::<u8>(num_blocks * bytes_per_block)
            .map_err(drv)?;
        stream.synchronize().map_err(drv)?;
        tracing::info!(
            device = %ctx.name().unwrap_or_default(),
            arch,
            model = %cfg.describe(),
            weights_mib = (weight_elems * 2) >> 20,
            kv_blocks = num_blocks,
            "CUDA executor ready"
        );
        let spec = ModelSpec {
            name: g
                .str_opt("general.name")
                .ok()
                .flatten()
                .map(|s| s.to_string())
                .unwrap_or_else(|| cfg.arch.clone()),
            arch: cfg.arch.clone(),
            n_layer: cfg.n_layer,
            n_embd: d,
            n_head: cfg.n_head,
            n_head_kv: cfg.n_head_kv,
            head_dim: cfg.head_dim,
            vocab,
            ctx_len: cfg.ctx_len,
            weight_bytes: weight_elems * 2,
        };
        Ok(CudaExecutor {
            sampler: SamplerScratch::with_capacity(vocab),
            offload: None,
            cfg,
            spec,
            ctx,
            stream,
            blas,
            f,
            tok_embd,
            head,
            out_norm,
            layers,
            inv_freq,
            kv,
            kv_dtype: c.kv_dtype,
            bytes_per_block,
            num_blocks,
            block_size: c.block_size,
            max_blocks,
            max_tokens: t,
            max_seqs: s,
            max_rows: o,
            b,
            host: Host::default(),
        })
    }

    /// `y[t][n] = sum_k x[t][k] * w[n][k]`: weights `[n][k]` f16 row-major,
    /// inputs `[t][k]` f16, outputs `[t][n]` f32.
    fn gemm(&self, w: u64, x: u64, y: u64, n: usize, k: usize, t: usize) -> Result<(), ExecError> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        // Column-major view: Y^T (n x t) = W (k x n)^T * X^T (k x t).
        // SAFETY: the pointers name live buffers of at least these sizes.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                t as i32,
                k as i32,
                (&alpha as *const f32).cast(),
                w as *const _,
                cudaDataType::CUDA_R_16F,
                k as i32,
                x as *const _,
                cudaDataType::CUDA_R_16F,
                k as i32,
                (&beta as *const f32).cast(),
                y as *mut _,
                cudaDataType::CUDA_R_32F,
                n as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(exec_err)
    }

    fn to_f16(&self, src: u64, dst: u64, n: usize) -> Result<(), ExecError> {
        let mut l = self.stream.launch_builder(&self.f.f32_to_f16);
        let n64 = n as i64;
        l.arg(&src).arg(&dst).arg(&n64);
        // SAFETY: argument types match the kernel's signature.
        unsafe { l.launch(flat(n)) }.map_err(exec_err)?;
        Ok(())
    }

    /// `hadamard_rows`: rotates each `n` of columns `col0..col0 + cols` of
    /// `rows_n` rows of `row_w` floats at `x`, in place.
    fn hadamard(
        &self,
        x: u64,
        rows_n: usize,
        row_w: usize,
        col0: usize,
        cols: usize,
        n: usize,
    ) -> Result<(), ExecError> {
        let mut l = self.stream.launch_builder(&self.f.hadamard_rows);
        let (nr, w, c0, n32) = (rows_n as i32, row_w as i32, col0 as i32, n as i32);
        let scale = flotilla_model::hadamard_scale(n);
        l.arg(&x).arg(&nr).arg(&w).arg(&c0).arg(&n32).arg(&scale);
        let cfg = LaunchConfig {
            grid_dim: (rows_n as u32, (cols / n) as u32, 1),
            block_dim: ((n / 2) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument types match the kernel's signature; every row
        // holds `col0 + cols` floats and `n` (a power of two <= 256)
        // divides `cols`.
        unsafe { l.launch(cfg) }.map_err(exec_err)?;
        Ok(())
    }

    /// `rms_norm_residual` over `rows_n` rows of `n_embd`: the residual add
    /// `x += delta` (`delta_w` null) or `x += rmsnorm(delta) * delta_w`
    /// (a post norm) when `delta` is not null, then `out = f16(rmsnorm(x) * w)`
    /// when `out` is not null.
    fn norm(
        &self,
        x: u64,
        (delta, delta_w): (u64, u64),
        w: u64,
        out: u64,
        rows_n: usize,
    ) -> Result<(), ExecError> {
        let mut l = self.stream.launch_builder(&self.f.rms_norm_residual);
        let (dim, eps) = (self.cfg.n_embd as i32, self.cfg.rms_eps);
        l.arg(&x)
            .arg(&delta)
            .arg(&delta_w)
            .arg(&w)
            .arg(&out)
            .arg(&dim)
            .arg(&eps);
        // SAFETY: as above.
        unsafe { l.launch(rows(rows_n, 256)) }.map_err(exec_err)?;
        Ok(())
    }

    fn forward(&mut self, batch: &[SeqInput<'_>], out: &mut StepOutputs) -> Result<(), ExecError> {
        let st = &self.stream;
        let (d, qd, kvd, ff, hd) = (
            self.cfg.n_embd,
            self.cfg.q_dim(),
            self.cfg.kv_dim(),
            self.cfg.n_ff,
            self.cfg.head_dim,
        );
        let qkv_w = qd + 2 * kvd;
        let h = &mut self.host;
        h.tokens.clear();
        h.tok_seq.clear();
        h.tok_pos.clear();
        h.rows.clear();
        h.tables.clear();
        out.seqs.clear();
        out.vocab = self.cfg.vocab;
        for (i, q) in batch.iter().enumerate() {
            for (j, &t) in q.tokens.iter().enumerate() {
                h.tokens.push(t);
                h.tok_seq.push(i as i32);
                h.tok_pos.push((q.start_pos + j) as i32);
            }
            let need = (q.start_pos + q.tokens.len()).div_ceil(self.block_size);
            h.tables
                .extend(q.block_table[..need].iter().map(|&b| b as i32));
            h.tables
                .extend(std::iter::repeat_n(0, self.max_blocks - need));
            let mut o = SeqOutput::default();
            let n = q.output.rows();
            if n > 0 {
                o.logits_row = Some(h.rows.len());
                let end = h.tokens.len() as i32;
                h.rows.extend(end - n as i32..end);
            }
            out.seqs.push(o);
        }
        let t_all = h.tokens.len();
        let n_out = h.rows.len();
        st.memcpy_htod(&h.tokens, &mut self.b.tokens.slice_mut(..t_all))
            .map_err(exec_err)?;
        st.memcpy_htod(&h.tok_seq, &mut self.b.tok_seq.slice_mut(..t_all))
            .map_err(exec_err)?;
        st.memcpy_htod(&h.tok_pos, &mut self.b.tok_pos.slice_mut(..t_all))
            .map_err(exec_err)?;
        st.memcpy_htod(&h.tables, &mut self.b.tables.slice_mut(..h.tables.len()))
            .map_err(exec_err)?;
        if n_out > 0 {
            st.memcpy_htod(&h.rows, &mut self.b.rows.slice_mut(..n_out))
                .map_err(exec_err)?;
        }

        let p = |s: &CudaSlice<f32>| ptr(s, st);
        let (x, delta, qkv, att) = (
            p(&self.b.x),
            p(&self.b.delta),
            p(&self.b.qkv),
            p(&self.b.att),
        );
        let (gate, upb) = (p(&self.b.gate), p(&self.b.up));
        let h16 = ptr(&self.b.h16, st);
        let (tokens, tok_seq, tok_pos, tables) = (
            ptr(&self.b.tokens, st),
            ptr(&self.b.tok_seq, st),
            ptr(&self.b.tok_pos, st),
            ptr(&self.b.tables, st),
        );
        let kv = ptr(&self.kv, st);
        let null = 0u64;
        let rot = match self.kv_dtype {
            KvDtype::Int8 => flotilla_model::int8_rotations(hd),
            _ => None,
        };
        let (n_tok, n_layer, n_head, n_kv, hd32, bs, mb) = (
            t_all as i32,
            self.cfg.n_layer as i32,
            self.cfg.n_head as i32,
            self.cfg.n_head_kv as i32,
            hd as i32,
            self.block_size as i32,
            self.max_blocks as i32,
        );

        // SAFETY (every launch of this step): the arguments match the
        // kernel's signature, and the addresses name live buffers sized at
        // load for max_batch_tokens / max_seqs / max_blocks, which
        // validate_batch and the checks in `step` keep this batch within.
        {
            let mut l = st.launch_builder(&self.f.embed);
            let (tab, dim, scale) = (ptr(&self.tok_embd, st), d as i32, self.cfg.embd_scale);
            l.arg(&tab)
                .arg(&tokens)
                .arg(&x)
                .arg(&n_tok)
                .arg(&dim)
                .arg(&scale);
            // SAFETY: see above.
            unsafe { l.launch(rows(t_all, 256)) }.map_err(exec_err)?;
        }
        let (neox, eps) = (
            i32::from(self.cfg.rope_style == RopeStyle::Neox),
            self.cfg.rms_eps,
        );
        // rope_qk: a warp per head, up to 8 warps.
        let rope_heads = self.cfg.n_head + 2 * self.cfg.n_head_kv;
        let rope_threads = 32 * rope_heads.min(8) as u32;
        let act = match self.cfg.act {
            Activation::Silu => &self.f.swiglu,
            Activation::GeluTanh => &self.f.geglu,
        };
        // The residual add still owed by the previous block: its output
        // (`delta`) and its post norm, fused into the next RMSNorm.
        let mut owed = (null, null);
        for (li, w) in self.layers.iter().enumerate() {
            let layer = li as i32;
            let spec = self.cfg.layers[li];
            // Attention: the previous layer's FFN residual fused into this norm.
            self.norm(x, owed, ptr(&w.attn_norm, st), h16, t_all)?;
            self.gemm(ptr(&w.wqkv, st), h16, qkv, qkv_w, d, t_all)?;
            {
                let mut l = st.launch_builder(&self.f.rope_qk);
                let bias = opt_ptr(w.bias.as_ref(), st);
                let (qn, kn) = match &w.qk_norm {
                    Some((q, k)) => (ptr(q, st), ptr(k, st)),
                    None => (null, null),
                };
                let freqs = ptr(&self.inv_freq, st) + (spec.rope * hd / 2 * 8) as u64;
                l.arg(&qkv)
                    .arg(&bias)
                    .arg(&qn)
                    .arg(&kn)
                    .arg(&freqs)
                    .arg(&tok_pos)
                    .arg(&n_tok)
                    .arg(&n_head)
                    .arg(&n_kv)
                    .arg(&hd32)
                    .arg(&neox)
                    .arg(&eps);
                // SAFETY: see above; `freqs` is row `spec.rope` of inv_freq.
                unsafe { l.launch(rows(t_all, rope_threads)) }.map_err(exec_err)?;
            }
            // An int8 cache holds its rows rotated (kv.cu, hadamard_rows):
            // the queries and keys by one matrix, the values by another.
            if let Some((rk, rv)) = rot {
                self.hadamard(qkv, t_all, qkv_w, 0, qd + kvd, rk)?;
                self.hadamard(qkv, t_all, qkv_w, qd + kvd, kvd, rv)?;
            }
            {
                let q8 = self.kv_dtype == KvDtype::Int8;
                let mut l = st.launch_builder(if q8 {
                    &self.f.kv_append_q8
                } else {
                    &self.f.kv_append
                });
                l.arg(&qkv)
                    .arg(&kv)
                    .arg(&tok_seq)
                    .arg(&tok_pos)
                    .arg(&tables)
                    .arg(&mb)
                    .arg(&n_tok)
                    .arg(&layer)
                    .arg(&n_layer)
                    .arg(&n_head)
                    .arg(&n_kv)
                    .arg(&hd32)
                    .arg(&bs);
                // SAFETY: see above.
                unsafe { l.launch(rows(t_all, 128)) }.map_err(exec_err)?;
            }
            {
                let mut l = st.launch_builder(if self.kv_dtype == KvDtype::Int8 {
                    &self.f.paged_attention_q8
                } else {
                    &self.f.paged_attention
                });
                let scale = self.cfg.attn_scale;
                // 0: global attention.
                let window = spec.window.map_or(0, |w| w.min(i32::MAX as usize) as i32);
                l.arg(&att)
                    .arg(&qkv)
                    .arg(&kv)
                    .arg(&tok_seq)
                    .arg(&tok_pos)
                    .arg(&tables)
                    .arg(&mb)
                    .arg(&n_tok)
                    .arg(&layer)
                    .arg(&n_layer)
                    .arg(&n_head)
                    .arg(&n_kv)
                    .arg(&hd32)
                    .arg(&bs)
                    .arg(&window)
                    .arg(&scale);
                let cfg = LaunchConfig {
                    grid_dim: (t_all as u32, self.cfg.n_head as u32, 1),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: see above.
                unsafe { l.launch(cfg) }.map_err(exec_err)?;
            }
            if let Some((_, rv)) = rot {
                self.hadamard(att, t_all, qd, 0, qd, rv)?;
            }
            self.to_f16(att, h16, t_all * qd)?;
            self.gemm(ptr(&w.wo, st), h16, delta, d, qd, t_all)?;
            // FFN, the attention residual (and its post norm) fused into its norm.
            let post_attn = opt_ptr(w.post_attn_norm.as_ref(), st);
            self.norm(x, (delta, post_attn), ptr(&w.ffn_norm, st), h16, t_all)?;
            self.gemm(ptr(&w.w_gate, st), h16, gate, ff, d, t_all)?;
            self.gemm(ptr(&w.w_up, st), h16, upb, ff, d, t_all)?;
            {
                let mut l = st.launch_builder(act);
                let n = (t_all * ff) as i64;
                l.arg(&gate).arg(&upb).arg(&h16).arg(&n);
                // SAFETY: see above.
                unsafe { l.launch(flat(t_all * ff)) }.map_err(exec_err)?;
            }
            self.gemm(ptr(&w.w_down, st), h16, delta, d, ff, t_all)?;
            owed = (delta, opt_ptr(w.post_ffn_norm.as_ref(), st));
        }
        if n_out == 0 {
            st.synchronize().map_err(exec_err)?;
            out.logits.clear();
            return Ok(());
        }
        // Last residual add, then only the rows that want logits.
        if owed.1 == null {
            let mut l = st.launch_builder(&self.f.add_rows);
            let n = (t_all * d) as i64;
            l.arg(&x).arg(&delta).arg(&n);
            // SAFETY: see above.
            unsafe { l.launch(flat(t_all * d)) }.map_err(exec_err)?;
        } else {
            // With a post norm: x += rmsnorm(delta) * w, no normalised output.
            self.norm(x, owed, null, null, t_all)?;
        }
        let xs = ptr(&self.b.xs, st);
        {
            let mut l = st.launch_builder(&self.f.gather_rows);
            let (rows_p, dim) = (ptr(&self.b.rows, st), d as i32);
            l.arg(&x).arg(&xs).arg(&rows_p).arg(&dim);
            // SAFETY: see above.
            unsafe { l.launch(rows(n_out, 256)) }.map_err(exec_err)?;
        }
        let hs16 = ptr(&self.b.hs16, st);
        self.norm(xs, (null, null), ptr(&self.out_norm, st), hs16, n_out)?;
        let vocab = self.cfg.vocab;
        let head = ptr(self.head.as_ref().unwrap_or(&self.tok_embd), st);
        self.gemm(head, hs16, ptr(&self.b.logits, st), vocab, d, n_out)?;
        // A step whose rows all sample greedily without logprobs, a bias or
        // a constraint (the common decode step) picks on the device and reads back one
        // token per row instead of a vocabulary of logits.
        let greedy = batch.iter().all(|q| match &q.output {
            OutputKind::None => true,
            OutputKind::Logits => false,
            OutputKind::Sample(p) | OutputKind::Verify { params: p, .. } => {
                (p.temperature == 0.0 || p.top_k == 1)
                    && !p.logprobs
                    && p.top_logprobs == 0
                    && q.bias.is_empty()
                    && q.draft_bias.is_empty()
                    && q.allow.is_none()
            }
        });
        if greedy {
            let mut l = st.launch_builder(&self.f.argmax_rows);
            let (lp, v, tk, tv) = (
                ptr(&self.b.logits, st),
                vocab as i32,
                ptr(&self.b.picks, st),
                ptr(&self.b.pick_vals, st),
            );
            l.arg(&lp).arg(&v).arg(&tk).arg(&tv);
            // SAFETY: see above.
            unsafe { l.launch(rows(n_out, 1024)) }.map_err(exec_err)?;
            let picks = &mut self.host.picks;
            picks.resize(n_out, 0);
            st.memcpy_dtoh(&self.b.picks.slice(..n_out), picks)
                .map_err(exec_err)?;
            st.synchronize().map_err(exec_err)?;
            out.logits.clear();
            for (i, q) in batch.iter().enumerate() {
                if q.output.sampling().is_some()
                    && let Some(first) = out.seqs[i].logits_row.take()
                {
                    sample_outputs(q, &mut out.seqs[i], |d| Sampled {
                        token: picks[first + d.row],
                        logprob: f32::NAN,
                        top: Vec::new(),
                    });
                }
            }
            return Ok(());
        }
        out.logits.resize(n_out * vocab, 0.0);
        st.memcpy_dtoh(&self.b.logits.slice(..n_out * vocab), &mut out.logits)
            .map_err(exec_err)?;
        st.synchronize().map_err(exec_err)?;
        // Sampling on the host: the rows are here already, and the CPU
        // sampler's draws are a function of (seed, position), so a request
        // samples alike on either backend.
        for (i, q) in batch.iter().enumerate() {
            if q.output.sampling().is_none() {
                continue;
            }
            let first = out.seqs[i].logits_row.expect("sampled rows have logits");
            // The masks are read only now, inside: they were computed
            // while the GPU ran.
            let (logits, sampler) = (&out.logits, &mut self.sampler);
            sample_outputs(q, &mut out.seqs[i], |d| {
                let row = first + d.row;
                sample(
                    &logits[row * vocab..(row + 1) * vocab],
                    d.params,
                    d.bias,
                    d.allow,
                    d.position,
                    sampler,
                )
            });
        }
        Ok(())
    }

    /// The offload tier's base pointer and `slot`'s byte offset in it.
    fn slot_at(&self, slot: u32) -> Result<(*mut u8, usize), ExecError> {
        match &self.offload {
            Some((_, base, slots)) if slot < *slots => {
                Ok((*base, slot as usize * self.bytes_per_block))
            }
            Some((_, _, slots)) => Err(ExecError::Backend(format!(
                "offload slot {slot} of {slots}"
            ))),
            None => Err(ExecError::Backend("no offload tier attached".into())),
        }
    }

    fn block_range(&self, block: u32) -> Result<std::ops::Range<usize>, ExecError> {
        let b = block as usize;
        if b >= self.num_blocks {
            return Err(ExecError::BadBlock {
                block,
                num_blocks: self.num_blocks,
            });
        }
        Ok(b * self.bytes_per_block..(b + 1) * self.bytes_per_block)
    }
}

/// Uploads weights, dequantising to f16.
struct Uploader<'a> {
    stream: &'a Arc<CudaStream>,
    f: &'a Funcs,
    g: &'a GgufFile,
}

impl Uploader<'_> {
    fn vector(&mut self, name: &str, n: usize) -> Result<CudaSlice<f32>, CudaError> {
        let v = self.host_vector(name, n)?;
        self.stream.clone_htod(&v).map_err(drv)
    }

    /// A vector of `n` floats (norm weights, biases, RoPE factors), read
    /// on the host.
    fn host_vector(&mut self, name: &str, n: usize) -> Result<Vec<f32>, CudaError> {
        let t = self.g.tensor(name)?;
        if t.elems() != n as u64 || t.ty.block_elems() != 1 {
            return Err(CudaError::Model(GgufError::UnsupportedType {
                tensor: name.to_string(),
                ty: format!(
                    "{} with {} elements (a vector of {n})",
                    t.ty.name(),
                    t.elems()
                ),
            }));
        }
        let mut v = vec![0f32; n];
        flotilla_model::quant::dequantize(t.ty, self.g.tensor_bytes(t), &mut v);
        Ok(v)
    }

    fn matrix(
        &mut self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<CudaSlice<u16>, CudaError> {
        self.stacked(&[(name, rows)], cols)
    }

    /// Matrices of `cols` columns stacked row-wise into one f16 buffer.
    fn stacked(
        &mut self,
        parts: &[(&str, usize)],
        cols: usize,
    ) -> Result<CudaSlice<u16>, CudaError> {
        let total: usize = parts.iter().map(|p| p.1).sum();
        let mut dst = self.stream.alloc_zeros::<u16>(total * cols).map_err(drv)?;
        let mut row = 0;
        for &(name, rows) in parts {
            let t = self.g.tensor(name)?;
            if t.dims != [cols as u64, rows as u64] {
                return Err(CudaError::Model(GgufError::BadShape {
                    tensor: name.to_string(),
                    found: t.dims.clone(),
                    expected: vec![cols as u64, rows as u64],
                }));
            }
            let bytes = self.g.tensor_bytes(t);
            let n = rows * cols;
            let off = row * cols;
            let func = match t.ty {
                GgmlType::Q8_0 => Some(&self.f.dequant_q8_0),
                GgmlType::Q4_0 => Some(&self.f.dequant_q4_0),
                GgmlType::Q4_1 => Some(&self.f.dequant_q4_1),
                GgmlType::BF16 => Some(&self.f.bf16_to_f16),
                _ => None,
            };
            match func {
                _ if t.ty == GgmlType::F16 => {
                    let h: Vec<u16> = bytes
                        .chunks_exact(2)
                        .map(|b| u16::from_le_bytes([b[0], b[1]]))
                        .collect();
                    self.stream
                        .memcpy_htod(&h, &mut dst.slice_mut(off..off + n))
                        .map_err(drv)?;
                }
                Some(func) => {
                    let raw = self.stream.clone_htod(bytes).map_err(drv)?;
                    // Blocks for the dequantisers, elements for bf16.
                    let n_blocks = (n as u64 / t.ty.block_elems()) as i64;
                    let (src, out) = (
                        ptr(&raw, self.stream),
                        ptr(&dst, self.stream) + 2 * off as u64,
                    );
                    let mut l = self.stream.launch_builder(func);
                    l.arg(&src).arg(&out).arg(&n_blocks);
                    // SAFETY: `raw` holds n_blocks whole blocks, `dst` room for them.
                    unsafe { l.launch(flat(n)) }.map_err(drv)?;
                    // `raw` is freed on the stream, after the kernel.
                    drop(raw);
                }
                None => {
                    let mut f = vec![0f32; n];
                    flotilla_model::quant::dequantize(t.ty, bytes, &mut f);
                    let h: Vec<u16> = f
                        .iter()
                        .map(|&v| half::f16::from_f32(v).to_bits())
                        .collect();
                    self.stream
                        .memcpy_htod(&h, &mut dst.slice_mut(off..off + n))
                        .map_err(drv)?;
                }
            }
            row += rows;
        }
        Ok(dst)
    }
}

impl Executor for CudaExecutor {
    fn model_spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn kv_spec(&self) -> KvSpec {
        KvSpec {
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            dtype: self.kv_dtype,
            bytes_per_block: self.bytes_per_block,
        }
    }

    fn max_batch_tokens(&self) -> usize {
        self.max_tokens
    }

    /// The output rows past one per sequence.
    fn max_draft_tokens(&self) -> usize {
        self.max_rows - self.max_seqs
    }

    fn step(&mut self, batch: &[SeqInput<'_>], out: &mut StepOutputs) -> Result<(), ExecError> {
        let limits = BatchLimits {
            vocab: self.cfg.vocab,
            ctx_len: self.cfg.ctx_len,
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            max_tokens: self.max_tokens,
        };
        validate_batch(batch, &limits, &mut self.host.slots)?;
        let rows: usize = batch.iter().map(|q| q.output.rows()).sum();
        if rows > self.max_rows {
            return Err(ExecError::BadSampling {
                seq: 0,
                reason: format!(
                    "{rows} output rows (samples and verified draft positions) exceed \
                     the {} this backend holds",
                    self.max_rows
                ),
            });
        }
        if batch.len() > self.max_seqs {
            return Err(ExecError::TooManySequences {
                seqs: batch.len(),
                max: self.max_seqs,
            });
        }
        self.ctx.bind_to_thread().map_err(exec_err)?;
        self.forward(batch, out)
    }

    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), ExecError> {
        self.block_range(src)?;
        self.block_range(dst)?;
        self.ctx.bind_to_thread().map_err(exec_err)?;
        let mut l = self.stream.launch_builder(&self.f.copy_block);
        // In 2-byte units: every dtype's block is an even number of bytes.
        let units = self.bytes_per_block / 2;
        let (kv, s, d, n) = (
            ptr(&self.kv, &self.stream),
            src as i32,
            dst as i32,
            units as i64,
        );
        l.arg(&kv).arg(&s).arg(&d).arg(&n);
        // SAFETY: both blocks checked above.
        unsafe { l.launch(flat(units / 8)) }.map_err(exec_err)?;
        Ok(())
    }

    fn read_block(&self, block: u32, out: &mut [u8]) -> Result<(), ExecError> {
        let r = self.block_range(block)?;
        if out.len() != r.len() {
            return Err(ExecError::BadBlockBytes {
                got: out.len(),
                expected: r.len(),
            });
        }
        self.ctx.bind_to_thread().map_err(exec_err)?;
        self.stream
            .memcpy_dtoh(&self.kv.slice(r), out)
            .map_err(exec_err)?;
        self.stream.synchronize().map_err(exec_err)?;
        Ok(())
    }

    fn write_block(&mut self, block: u32, data: &[u8]) -> Result<(), ExecError> {
        let r = self.block_range(block)?;
        if data.len() != r.len() {
            return Err(ExecError::BadBlockBytes {
                got: data.len(),
                expected: r.len(),
            });
        }
        self.ctx.bind_to_thread().map_err(exec_err)?;
        self.stream
            .memcpy_htod(data, &mut self.kv.slice_mut(r))
            .map_err(exec_err)?;
        self.stream.synchronize().map_err(exec_err)?;
        Ok(())
    }

    fn attach_offload(&mut self, slots: u32) -> Result<bool, ExecError> {
        self.ctx.bind_to_thread().map_err(exec_err)?;
        let len = slots as usize * self.bytes_per_block;
        // SAFETY: the bytes are unset until a spill writes a slot, and the
        // pool restores only slots a spill wrote. Flags 0: plain page-locked
        // memory (write-combined memory would be slow to read back).
        let mut tier =
            unsafe { self.ctx.alloc_pinned_with_flags::<u8>(len, 0) }.map_err(exec_err)?;
        // No copy has used the slice's event yet, so this does not wait.
        let base = tier.as_mut_ptr().map_err(exec_err)?;
        self.offload = Some((tier, base, slots));
        Ok(true)
    }

    fn spill_to_slot(&mut self, block: u32, slot: u32) -> Result<(), ExecError> {
        let r = self.block_range(block)?;
        let (base, at) = self.slot_at(slot)?;
        self.ctx.bind_to_thread().map_err(exec_err)?;
        let src = self.kv.slice(r);
        let (ptr, _record) = src.device_ptr(&self.stream);
        // SAFETY: `at..at + bytes_per_block` lies inside the pinned
        // allocation (slot_at); the copy is queued on the step's stream, so
        // it reads the block before any later kernel writes it, and only
        // later copies on the same stream touch that slot.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(base.add(at), self.bytes_per_block);
            cudarc::driver::result::memcpy_dtoh_async(dst, ptr, self.stream.cu_stream())
        }
        .map_err(exec_err)
    }

    fn restore_from_slot(&mut self, slot: u32, block: u32) -> Result<(), ExecError> {
        let r = self.block_range(block)?;
        let (base, at) = self.slot_at(slot)?;
        self.ctx.bind_to_thread().map_err(exec_err)?;
        let mut dst = self.kv.slice_mut(r);
        let (ptr, _record) = dst.device_ptr_mut(&self.stream);
        // SAFETY: as in `spill_to_slot`; the copy lands before the step
        // queued after it on the same stream reads the block.
        unsafe {
            let src = std::slice::from_raw_parts(base.add(at).cast_const(), self.bytes_per_block);
            cudarc::driver::result::memcpy_htod_async(ptr, src, self.stream.cu_stream())
        }
        .map_err(exec_err)
    }
}
