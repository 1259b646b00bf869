//! Architectures as data: one description, read from GGUF metadata and the
//! file's tensors, that the CPU and CUDA forward passes both consume.
//!
//! A family (Llama, Mistral, Qwen2, Gemma 3) differs from another only in the
//! pieces it has: per-layer attention kind (global or sliding window, and the
//! RoPE base of each), QK-norm, norms after attention and FFN, Q/K/V biases,
//! embedding scale, the FFN's activation, tied or separate head, the RoPE
//! pair layout and Llama 3's frequency factors. Which pieces a file has is
//! read from it (optional tensors are looked up by name); the few facts a
//! GGUF does not store (Gemma's activation, embedding scale, local RoPE base,
//! window pattern) come from the family table below.

use std::sync::Arc;

use crate::kernels::{Bytes, QMatrix, Resolved, WData};
use crate::quant;
use flotilla_gguf::{GgmlType, GgufError, GgufFile, TensorInfo};

/// How RoPE pairs a head's dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(x[2i], x[2i+1])` (GGUF/llama.cpp "normal": Llama, Mistral).
    Normal,
    /// Halves `(x[i], x[i + d/2])` (llama.cpp "NEOX": Qwen2, Gemma).
    Neox,
}

/// The FFN's gate activation (gated: `down(act(gate x) * up x)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `x * sigmoid(x)` (SwiGLU).
    Silu,
    /// GELU with the tanh approximation (GeGLU).
    GeluTanh,
}

/// What one transformer block's attention looks like.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerSpec {
    /// Sliding window in tokens (the query and the `window - 1` before it);
    /// `None` for global attention.
    pub window: Option<usize>,
    /// Index into [`ModelConfig::rope_bases`].
    pub rope: usize,
}

/// Hyper-parameters and pieces of a decoder-only transformer.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// `general.architecture`.
    pub arch: String,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Residual width.
    pub n_embd: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (grouped-query attention when fewer than `n_head`).
    pub n_head_kv: usize,
    /// Dimension of one head (`n_head * head_dim` need not equal `n_embd`).
    pub head_dim: usize,
    /// FFN hidden width.
    pub n_ff: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// Training context length: the longest sequence accepted.
    pub ctx_len: usize,
    /// Vocabulary size (rows of the token embedding).
    pub vocab: usize,
    /// Per layer: window and RoPE base.
    pub layers: Vec<LayerSpec>,
    /// Distinct RoPE bases (global first); layers index into it.
    pub rope_bases: Vec<f32>,
    /// How RoPE pairs dimensions.
    pub rope_style: RopeStyle,
    /// The FFN's activation.
    pub act: Activation,
    /// Factor on the token embedding (Gemma: sqrt(n_embd); else 1).
    pub embd_scale: f32,
    /// Factor on attention scores (1/sqrt(head_dim) unless the family says otherwise).
    pub attn_scale: f32,
    /// Per-head RMSNorm of Q and K before RoPE.
    pub qk_norm: bool,
    /// RMSNorm of the attention and FFN outputs before the residual add.
    pub post_norms: bool,
    /// Biases on the Q, K and V projections.
    pub qkv_bias: bool,
    /// Llama 3 frequency factors (`rope_freqs.weight`) divide RoPE's frequencies.
    pub rope_factors: bool,
    /// A separate output head (else tied to the token embedding).
    pub separate_head: bool,
    /// Which layers of the file this configuration runs, and whether it
    /// holds the model's ends (a pipeline stage's part; the whole model
    /// from [`ModelConfig::from_gguf`]). `n_layer` and `layers` are the
    /// part's; local layer `i` is the file's `part.layers.start + i`.
    pub part: Part,
}

/// A pipeline stage's share of a model: a run of the file's layers, and
/// whether it also holds the ends (the token embedding, the final norm and
/// the output head: the stage that embeds a step's tokens and samples its
/// outputs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Part {
    /// The file's layers, in order.
    pub layers: std::ops::Range<usize>,
    /// The embedding, final norm and head are here.
    pub ends: bool,
    /// Layers in the file.
    pub total: usize,
}

impl Part {
    /// Whether this is the whole model.
    pub fn is_whole(&self) -> bool {
        self.ends && self.layers == (0..self.total)
    }
}

/// What a family fixes that its GGUF files do not store.
struct Family {
    rope_style: RopeStyle,
    act: Activation,
    /// Embedding scale is sqrt(n_embd).
    scale_embd: bool,
    /// RoPE base of sliding-window layers, when they have their own.
    local_rope_base: Option<f32>,
    /// Layers `il` with `il % period != period - 1` use the sliding window
    /// (`attention.sliding_window`), when the file does not say per layer.
    swa_period: Option<usize>,
}

/// Architectures this module runs, and what each fixes.
fn family(arch: &str) -> Option<Family> {
    let plain = Family {
        rope_style: RopeStyle::Normal,
        act: Activation::Silu,
        scale_embd: false,
        local_rope_base: None,
        swa_period: None,
    };
    Some(match arch {
        "llama" | "mistral" => plain,
        "qwen2" => Family {
            rope_style: RopeStyle::Neox,
            ..plain
        },
        "gemma3" => Family {
            rope_style: RopeStyle::Neox,
            act: Activation::GeluTanh,
            scale_embd: true,
            local_rope_base: Some(10_000.0),
            swa_period: Some(6),
        },
        _ => return None,
    })
}

/// `general.architecture` values that [`ModelConfig::from_gguf`] accepts.
pub const ARCHITECTURES: &[&str] = &["llama", "mistral", "qwen2", "gemma3"];

impl ModelConfig {
    /// The configuration of a pipeline stage that runs the file's layers
    /// `layers` (at least one) and holds the ends when `ends`; refused
    /// unless this is the whole model and the range lies within it.
    pub fn part(&self, layers: std::ops::Range<usize>, ends: bool) -> Result<ModelConfig, String> {
        if !self.part.is_whole() {
            return Err("a part can only be cut from the whole model".into());
        }
        if layers.is_empty() || layers.end > self.n_layer {
            return Err(format!(
                "layers {}..{} are not a non-empty range of the model's {} layers",
                layers.start, layers.end, self.n_layer
            ));
        }
        let mut c = self.clone();
        c.n_layer = layers.len();
        c.layers = self.layers[layers.clone()].to_vec();
        c.part = Part {
            layers,
            ends,
            total: self.n_layer,
        };
        Ok(c)
    }

    /// Reads the description from GGUF metadata and the file's tensor names.
    pub fn from_gguf(g: &GgufFile) -> Result<ModelConfig, GgufError> {
        let arch = g.str("general.architecture")?.to_string();
        let Some(fam) = family(&arch) else {
            return Err(GgufError::UnknownArchitecture(arch));
        };
        let k = |s: &str| format!("{arch}.{s}");
        let n_embd = g.u64(&k("embedding_length"))? as usize;
        let n_head = g.u64(&k("attention.head_count"))? as usize;
        let n_head_kv = g
            .u64_opt(&k("attention.head_count_kv"))?
            .map_or(n_head, |v| v as usize);
        if n_head == 0 || n_head_kv == 0 || !n_head.is_multiple_of(n_head_kv) {
            return Err(GgufError::Invalid(format!(
                "head counts do not divide: heads {n_head}, kv heads {n_head_kv}"
            )));
        }
        if n_embd == 0
            || (g.get(&k("attention.key_length")).is_none() && !n_embd.is_multiple_of(n_head))
        {
            return Err(GgufError::Invalid(format!(
                "embedding {n_embd} is not a multiple of the {n_head} heads"
            )));
        }
        let head_dim = g
            .u64_opt(&k("attention.key_length"))?
            .map_or(n_embd / n_head, |v| v as usize);
        let v_dim = g
            .u64_opt(&k("attention.value_length"))?
            .map_or(head_dim, |v| v as usize);
        if head_dim == 0 || head_dim % 8 != 0 || head_dim > 1024 || v_dim != head_dim {
            return Err(GgufError::Invalid(format!(
                "head dimension {head_dim} (values {v_dim}) must be a multiple of 8, at most 1024, \
                 the same for keys and values"
            )));
        }
        let tok = g.tensor("token_embd.weight")?;
        let vocab = tok.dims.get(1).copied().unwrap_or(0) as usize;
        let n_layer = g.u64(&k("block_count"))? as usize;
        let rope_base = g.f64_opt(&k("rope.freq_base"))?.unwrap_or(10_000.0) as f32;
        let window = g
            .u64_opt(&k("attention.sliding_window"))?
            .map(|v| v as usize)
            .filter(|_| fam.swa_period.is_some());
        let mut rope_bases = vec![rope_base];
        let local_rope = match (window, fam.local_rope_base) {
            (Some(_), Some(b)) if b != rope_base => {
                rope_bases.push(b);
                1
            }
            _ => 0,
        };
        let sliding = |il: usize| match (window, fam.swa_period) {
            (Some(_), Some(p)) => il % p != p - 1,
            _ => false,
        };
        if window == Some(0) {
            return Err(GgufError::Invalid("sliding window of 0 tokens".into()));
        }
        let layers = (0..n_layer.min(1024))
            .map(|il| {
                if sliding(il) {
                    LayerSpec {
                        window,
                        rope: local_rope,
                    }
                } else {
                    LayerSpec {
                        window: None,
                        rope: 0,
                    }
                }
            })
            .collect();
        let has = |name: &str| g.has_tensor(name);
        let cfg = ModelConfig {
            n_layer,
            n_embd,
            n_head,
            n_head_kv,
            head_dim,
            n_ff: g.u64(&k("feed_forward_length"))? as usize,
            rms_eps: g
                .f64_opt(&k("attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-5) as f32,
            ctx_len: g.u64(&k("context_length"))? as usize,
            vocab,
            layers,
            rope_bases,
            rope_style: fam.rope_style,
            act: fam.act,
            embd_scale: if fam.scale_embd {
                (n_embd as f32).sqrt()
            } else {
                1.0
            },
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            qk_norm: has("blk.0.attn_q_norm.weight"),
            post_norms: has("blk.0.post_attention_norm.weight"),
            qkv_bias: has("blk.0.attn_q.bias"),
            rope_factors: has("rope_freqs.weight"),
            separate_head: has("output.weight"),
            part: Part {
                layers: 0..n_layer,
                ends: true,
                total: n_layer,
            },
            arch,
        };
        let finite_pos = |v: f32| v.is_finite() && v > 0.0;
        if cfg.n_layer == 0
            || cfg.n_layer > 1024
            || cfg.ctx_len == 0
            || cfg.ctx_len > 1 << 24
            || cfg.vocab == 0
            || cfg.n_ff == 0
            || !finite_pos(cfg.rms_eps)
            || !cfg.rope_bases.iter().all(|&b| finite_pos(b))
        {
            return Err(GgufError::Invalid(format!(
                "implausible model shape: {cfg:?}"
            )));
        }
        Ok(cfg)
    }

    /// K and V floats per token per layer.
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    /// Query floats per token (the attention output's width).
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// One line naming the pieces, for logs and `bench-model`.
    pub fn describe(&self) -> String {
        let n_swa = self.layers.iter().filter(|l| l.window.is_some()).count();
        let mut parts = vec![format!(
            "{}: {} layers, {} wide, {}x{} heads ({} kv), ffn {} {:?}, vocab {}",
            self.arch,
            self.n_layer,
            self.n_embd,
            self.n_head,
            self.head_dim,
            self.n_head_kv,
            self.n_ff,
            self.act,
            self.vocab
        )];
        if n_swa > 0 {
            let w = self.layers.iter().find_map(|l| l.window).unwrap_or(0);
            parts.push(format!("{n_swa} sliding-window layers ({w})"));
        }
        for (on, name) in [
            (self.qk_norm, "qk-norm"),
            (self.post_norms, "post-norms"),
            (self.qkv_bias, "qkv-bias"),
            (self.rope_factors, "rope-factors"),
            (!self.separate_head, "tied head"),
        ] {
            if on {
                parts.push(name.to_string());
            }
        }
        parts.join(", ")
    }
}

/// The Q, K and V biases of a block.
pub struct QkvBias {
    /// `q_dim` floats.
    pub q: Vec<f32>,
    /// `kv_dim` floats.
    pub k: Vec<f32>,
    /// `kv_dim` floats.
    pub v: Vec<f32>,
}

/// One transformer block.
pub struct Layer {
    /// RMSNorm weight before attention.
    pub attn_norm: Vec<f32>,
    /// Query projection (`q_dim` rows).
    pub wq: QMatrix,
    /// Key projection (`kv_dim` rows).
    pub wk: QMatrix,
    /// Value projection (`kv_dim` rows).
    pub wv: QMatrix,
    /// Attention output projection (`n_embd` x `q_dim`).
    pub wo: QMatrix,
    /// Q/K/V biases, when the family has them.
    pub bias: Option<QkvBias>,
    /// Per-head RMSNorm weights of Q and K (`head_dim` each).
    pub qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    /// RMSNorm weight of the attention output, before the residual add.
    pub post_attn_norm: Option<Vec<f32>>,
    /// RMSNorm weight before the FFN.
    pub ffn_norm: Vec<f32>,
    /// FFN gate.
    pub w_gate: QMatrix,
    /// FFN up.
    pub w_up: QMatrix,
    /// FFN down projection.
    pub w_down: QMatrix,
    /// RMSNorm weight of the FFN output, before the residual add.
    pub post_ffn_norm: Option<Vec<f32>>,
}

/// All weights of a model, in kernel layouts.
pub struct Weights {
    /// Token embedding, one row per token id (also the output head when tied).
    pub tok_embd: QMatrix,
    /// Transformer blocks.
    pub layers: Vec<Layer>,
    /// Final RMSNorm weight.
    pub output_norm: Vec<f32>,
    /// Separate output head; `None` when tied to the embedding.
    pub output: Option<QMatrix>,
    /// Llama 3 RoPE frequency factors (`head_dim / 2`).
    pub rope_factors: Option<Vec<f32>>,
}

impl Weights {
    /// Loads every tensor in the layouts `kernel` reads, zero-copy where the
    /// file's layout is one (see [`matrix`]).
    pub fn load(g: &GgufFile, cfg: &ModelConfig, kernel: Resolved) -> Result<Weights, GgufError> {
        Self::load_with(g, cfg, kernel, false, None, 1)
    }

    /// [`Weights::load`] on `threads` threads (each converts whole
    /// matrices, the largest first), K-quants at the file's size where
    /// `compact` and the kernel reads them so (see [`matrix`]), taking
    /// each matrix the layout cache
    /// `cached` holds from it (a view of its mapped file) instead of
    /// converting it.
    pub fn load_with(
        g: &GgufFile,
        cfg: &ModelConfig,
        kernel: Resolved,
        compact: bool,
        cached: Option<&crate::layout::Cached>,
        threads: usize,
    ) -> Result<Weights, GgufError> {
        use std::sync::Mutex;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let mut jobs = matrix_shapes(cfg);
        jobs.sort_by_key(|&(_, r, c)| std::cmp::Reverse(r * c));
        let done: Vec<Mutex<Option<Result<QMatrix, GgufError>>>> =
            jobs.iter().map(|_| Mutex::new(None)).collect();
        let next = AtomicUsize::new(0);
        let work = || {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some((name, rows, cols)) = jobs.get(i) else {
                    break;
                };
                let m = match cached.and_then(|c| c.matrix(name, *rows, *cols)) {
                    Some(m) => Ok(m),
                    None => matrix(g, name, *rows, *cols, kernel, compact),
                };
                *done[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(m);
            }
        };
        std::thread::scope(|s| {
            for _ in 1..threads.clamp(1, jobs.len().max(1)) {
                s.spawn(work);
            }
            work();
        });
        let mut built = std::collections::HashMap::with_capacity(jobs.len());
        for ((name, _, _), m) in jobs.into_iter().zip(done) {
            let m = m.into_inner().unwrap_or_else(|e| e.into_inner());
            built.insert(name, m.expect("every job ran")?);
        }
        let mut matrix = |name: &str, _rows: usize, _cols: usize| -> Result<QMatrix, GgufError> {
            Ok(built
                .remove(name)
                .expect("every matrix is in matrix_shapes"))
        };
        let (d, qd, kvd, ff) = (cfg.n_embd, cfg.q_dim(), cfg.kv_dim(), cfg.n_ff);
        let hd = cfg.head_dim;
        let ends = cfg.part.ends;
        // A stage without the ends holds an empty embedding (no rows).
        let tok_embd = if ends {
            matrix("token_embd.weight", cfg.vocab, d)?
        } else {
            QMatrix::new(0, d, WData::F32(Vec::new()))
        };
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in cfg.part.layers.clone() {
            let n = |s: &str| format!("blk.{i}.{s}");
            let bias = if cfg.qkv_bias {
                Some(QkvBias {
                    q: vector(g, &n("attn_q.bias"), qd)?,
                    k: vector(g, &n("attn_k.bias"), kvd)?,
                    v: vector(g, &n("attn_v.bias"), kvd)?,
                })
            } else {
                None
            };
            let qk_norm = if cfg.qk_norm {
                Some((
                    vector(g, &n("attn_q_norm.weight"), hd)?,
                    vector(g, &n("attn_k_norm.weight"), hd)?,
                ))
            } else {
                None
            };
            let post = |name: &str| -> Result<Option<Vec<f32>>, GgufError> {
                if cfg.post_norms {
                    Ok(Some(vector(g, &n(name), d)?))
                } else {
                    Ok(None)
                }
            };
            layers.push(Layer {
                attn_norm: vector(g, &n("attn_norm.weight"), d)?,
                wq: matrix(&n("attn_q.weight"), qd, d)?,
                wk: matrix(&n("attn_k.weight"), kvd, d)?,
                wv: matrix(&n("attn_v.weight"), kvd, d)?,
                wo: matrix(&n("attn_output.weight"), d, qd)?,
                bias,
                qk_norm,
                post_attn_norm: post("post_attention_norm.weight")?,
                ffn_norm: vector(g, &n("ffn_norm.weight"), d)?,
                w_gate: matrix(&n("ffn_gate.weight"), ff, d)?,
                w_up: matrix(&n("ffn_up.weight"), ff, d)?,
                w_down: matrix(&n("ffn_down.weight"), d, ff)?,
                post_ffn_norm: post("post_ffw_norm.weight")?,
            });
        }
        let output = if ends && cfg.separate_head {
            Some(matrix("output.weight", cfg.vocab, d)?)
        } else {
            None
        };
        let rope_factors = if cfg.rope_factors {
            let f = vector(g, "rope_freqs.weight", hd / 2)?;
            if !f.iter().all(|v| v.is_finite() && *v > 0.0) {
                return Err(GgufError::Invalid(
                    "rope_freqs.weight holds a factor that is not a positive number".into(),
                ));
            }
            Some(f)
        } else {
            None
        };
        Ok(Weights {
            tok_embd,
            layers,
            output_norm: if ends {
                vector(g, "output_norm.weight", d)?
            } else {
                Vec::new()
            },
            output,
            rope_factors,
        })
    }

    /// Every matrix with its tensor name.
    pub fn matrices(&self) -> Vec<(String, &QMatrix)> {
        let mut v = vec![("token_embd.weight".to_string(), &self.tok_embd)];
        for (i, l) in self.layers.iter().enumerate() {
            for (n, m) in [
                ("attn_q", &l.wq),
                ("attn_k", &l.wk),
                ("attn_v", &l.wv),
                ("attn_output", &l.wo),
                ("ffn_gate", &l.w_gate),
                ("ffn_up", &l.w_up),
                ("ffn_down", &l.w_down),
            ] {
                v.push((format!("blk.{i}.{n}.weight"), m));
            }
        }
        if let Some(o) = &self.output {
            v.push(("output.weight".to_string(), o));
        }
        v
    }

    /// The matrix that maps the final hidden state to logits.
    pub fn head(&self) -> &QMatrix {
        self.output.as_ref().unwrap_or(&self.tok_embd)
    }

    /// Bytes of all weight matrices.
    pub fn bytes(&self) -> usize {
        let l: usize = self
            .layers
            .iter()
            .map(|l| {
                l.wq.bytes()
                    + l.wk.bytes()
                    + l.wv.bytes()
                    + l.wo.bytes()
                    + l.w_gate.bytes()
                    + l.w_up.bytes()
                    + l.w_down.bytes()
            })
            .sum();
        l + self.tok_embd.bytes() + self.output.as_ref().map_or(0, |o| o.bytes())
    }
}

/// Every weight matrix a model of `cfg` has: tensor name, rows, columns
/// (the names [`Weights::matrices`] gives).
pub fn matrix_shapes(cfg: &ModelConfig) -> Vec<(String, usize, usize)> {
    let (d, qd, kvd, ff) = (cfg.n_embd, cfg.q_dim(), cfg.kv_dim(), cfg.n_ff);
    let mut v = Vec::new();
    if cfg.part.ends {
        v.push(("token_embd.weight".to_string(), cfg.vocab, d));
    }
    for i in cfg.part.layers.clone() {
        for (n, r, c) in [
            ("attn_q", qd, d),
            ("attn_k", kvd, d),
            ("attn_v", kvd, d),
            ("attn_output", d, qd),
            ("ffn_gate", ff, d),
            ("ffn_up", ff, d),
            ("ffn_down", d, ff),
        ] {
            v.push((format!("blk.{i}.{n}.weight"), r, c));
        }
    }
    if cfg.part.ends && cfg.separate_head {
        v.push(("output.weight".to_string(), cfg.vocab, d));
    }
    v
}

/// RoPE's inverse frequencies of one base: `base^(-2i/head_dim) / factor_i`, in f64.
pub fn inv_freq(base: f32, head_dim: usize, factors: Option<&[f32]>) -> Vec<f64> {
    (0..head_dim / 2)
        .map(|i| {
            let f = (base as f64).powf(-2.0 * i as f64 / head_dim as f64);
            f / factors.map_or(1.0, |fs| fs[i] as f64)
        })
        .collect()
}

/// The index pairs that RoPE rotates together, for a head of `head_dim`:
/// pair `i` of `head_dim / 2`.
#[inline(always)]
pub fn rope_pair(style: RopeStyle, head_dim: usize, i: usize) -> (usize, usize) {
    match style {
        RopeStyle::Normal => (2 * i, 2 * i + 1),
        RopeStyle::Neox => (i, i + head_dim / 2),
    }
}

fn check_shape(t: &TensorInfo, expected: &[u64]) -> Result<(), GgufError> {
    if t.dims != expected {
        return Err(GgufError::BadShape {
            tensor: t.name.clone(),
            found: t.dims.clone(),
            expected: expected.to_vec(),
        });
    }
    Ok(())
}

fn vector(g: &GgufFile, name: &str, n: usize) -> Result<Vec<f32>, GgufError> {
    let t = g.tensor(name)?;
    check_shape(t, &[n as u64])?;
    let mut v = vec![0f32; n];
    if t.ty.block_elems() != 1 {
        return Err(GgufError::UnsupportedType {
            tensor: name.to_string(),
            ty: format!("{} (for a norm vector)", t.ty.name()),
        });
    }
    quant::dequantize(t.ty, g.tensor_bytes(t), &mut v);
    Ok(v)
}

/// Reads a `rows` x `cols` matrix into the layout `kernel` reads: Q4_0
/// and Q4_1 as interleaved Q4_1; Q8_0 zero-copy from the file, Q5_0
/// exactly as Q8_0, interleaved (`q + 128`) for the VNNI kernels; floats
/// as f32. Q4_K and Q6_K: with `compact` and a kernel that reads them so
/// (AVX2, AVX-512 VNNI, AMX), interleaved at the file's own size and bits (`quant::repack_q4_k_x8`,
/// `repack_q6_k_x8`: the bytes a token reads are the file's); otherwise
/// Q4_K as interleaved Q4_1 (sub-block scales rounded to f16) and Q6_K
/// requantised as Q8_0 (interleaved for VNNI): more bytes, fewer
/// instructions a weight. For the exact kernel, K-quants are kept as f32,
/// so it computes with the file's values.
pub fn matrix(
    g: &GgufFile,
    name: &str,
    rows: usize,
    cols: usize,
    kernel: Resolved,
    compact: bool,
) -> Result<QMatrix, GgufError> {
    let exact = kernel == Resolved::Exact;
    let native_k = compact && kernel.reads_compact_k() && cols.is_multiple_of(quant::QK_K);
    let t = g.tensor(name)?;
    check_shape(t, &[cols as u64, rows as u64])?;
    let bytes = g.tensor_bytes(t);
    let mapped = || Bytes::Mapped {
        map: Arc::clone(g.map()),
        start: t.start,
        len: t.len,
    };
    let data = match t.ty {
        GgmlType::Q4_K | GgmlType::Q6_K if exact => {
            let mut f = vec![0f32; rows * cols];
            quant::dequantize(t.ty, bytes, &mut f);
            WData::F32(f)
        }
        GgmlType::Q4_K if native_k => WData::Q4Kx8(quant::repack_q4_k_x8(bytes, rows, cols).into()),
        GgmlType::Q6_K if native_k => WData::Q6Kx8(quant::repack_q6_k_x8(bytes, rows, cols).into()),
        GgmlType::Q4_1 => WData::Q4_1x8(quant::repack_q4_1_x8(bytes, rows, cols).into()),
        GgmlType::Q8_0 => WData::Q8_0(mapped()),
        GgmlType::Q5_0 => WData::Q8_0(Bytes::Owned(quant::q5_0_to_q8_0(bytes))),
        GgmlType::Q4_0 => {
            WData::Q4_1x8(quant::repack_q4_1_x8(&quant::q4_0_to_q4_1(bytes), rows, cols).into())
        }
        GgmlType::Q4_K => {
            WData::Q4_1x8(quant::repack_q4_1_x8(&quant::q4_k_to_q4_1(bytes), rows, cols).into())
        }
        GgmlType::Q6_K => WData::Q8_0(Bytes::Owned(quant::q6_k_to_q8_0(bytes))),
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            let mut f = vec![0f32; rows * cols];
            quant::dequantize(t.ty, bytes, &mut f);
            WData::F32(f)
        }
    };
    // The VNNI kernels read Q8_0 interleaved, eight rows per load.
    let data = match data {
        WData::Q8_0(b) if kernel.vnni() => {
            WData::Q8_0x8(quant::repack_q8_0_x8(b.as_slice(), rows, cols).into())
        }
        other => other,
    };
    // What was copied into another layout need not stay resident twice.
    if !matches!(data, WData::Q8_0(Bytes::Mapped { .. })) {
        g.release(t);
    }
    Ok(QMatrix::new(rows, cols, data))
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_gguf::writer::{W, build};

    fn open(bytes: Vec<u8>) -> GgufFile {
        let path = std::env::temp_dir().join(format!(
            "flotilla-llama-{}-{}.gguf",
            std::process::id(),
            bytes.len()
        ));
        std::fs::write(&path, &bytes).unwrap();
        let g = GgufFile::open(&path).unwrap();
        std::fs::remove_file(&path).ok();
        g
    }

    #[test]
    fn unknown_architecture_is_named() {
        let g = open(build(&[("general.architecture", W::Str("gpt2"))], &[]));
        let err = ModelConfig::from_gguf(&g).unwrap_err().to_string();
        assert!(err.contains("unsupported architecture 'gpt2'"), "{err}");
    }

    #[test]
    fn missing_key_is_named() {
        let emb = vec![0u8; 64 * 4 * 4];
        let g = open(build(
            &[
                ("general.architecture", W::Str("llama")),
                ("llama.embedding_length", W::U32(64)),
            ],
            &[("token_embd.weight", &[64, 4], 0, &emb)],
        ));
        let err = ModelConfig::from_gguf(&g).unwrap_err().to_string();
        assert!(
            err.contains("missing metadata key 'llama.attention.head_count'"),
            "{err}"
        );
    }

    #[test]
    fn wrong_tensor_shape_is_named() {
        let emb = vec![0u8; 64 * 4 * 4];
        let meta = [
            ("general.architecture", W::Str("llama")),
            ("llama.embedding_length", W::U32(64)),
            ("llama.attention.head_count", W::U32(8)),
            ("llama.block_count", W::U32(1)),
            ("llama.feed_forward_length", W::U32(128)),
            ("llama.context_length", W::U32(256)),
        ];
        let g = open(build(
            &meta,
            &[
                ("token_embd.weight", &[64, 4], 0, &emb),
                ("output_norm.weight", &[32], 0, &emb[..128]),
            ],
        ));
        let cfg = ModelConfig::from_gguf(&g).unwrap();
        let err = Weights::load(&g, &cfg, Resolved::Scalar)
            .err()
            .expect("must fail")
            .to_string();
        // The matrices load first (in parallel, the largest first), so the
        // first missing tensor named is the largest of layer 0's.
        assert!(
            err.contains("missing tensor 'blk.0.ffn_gate.weight'"),
            "{err}"
        );
        assert!(
            vector(&g, "output_norm.weight", 64)
                .unwrap_err()
                .to_string()
                .contains("shape")
        );
    }
}
