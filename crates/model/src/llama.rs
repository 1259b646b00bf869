//! Llama-family weights and hyper-parameters, read from a GGUF file.

use std::sync::Arc;

use crate::gguf::{GgmlType, GgufError, GgufFile, TensorInfo};
use crate::kernels::{Bytes, QMatrix, WData};
use crate::quant;

/// Architectures whose GGUF layout this module runs (same tensors, same RoPE).
const ARCHITECTURES: &[&str] = &["llama", "mistral"];

/// Hyper-parameters of a Llama-family model.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
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
    /// Dimension of one head.
    pub head_dim: usize,
    /// SwiGLU hidden width.
    pub n_ff: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// RoPE frequency base.
    pub rope_base: f32,
    /// Training context length: the longest sequence accepted.
    pub ctx_len: usize,
    /// Vocabulary size (rows of the token embedding).
    pub vocab: usize,
}

impl LlamaConfig {
    /// Reads the hyper-parameters from GGUF metadata.
    pub fn from_gguf(g: &GgufFile) -> Result<LlamaConfig, GgufError> {
        let arch = g.str("general.architecture")?.to_string();
        if !ARCHITECTURES.contains(&arch.as_str()) {
            return Err(GgufError::UnknownArchitecture(arch));
        }
        let k = |s: &str| format!("{arch}.{s}");
        let n_embd = g.u64(&k("embedding_length"))? as usize;
        let n_head = g.u64(&k("attention.head_count"))? as usize;
        let n_head_kv = g
            .u64_opt(&k("attention.head_count_kv"))?
            .map_or(n_head, |v| v as usize);
        if n_head == 0
            || n_head_kv == 0
            || !n_embd.is_multiple_of(n_head)
            || !n_head.is_multiple_of(n_head_kv)
        {
            return Err(GgufError::Invalid(format!(
                "head counts do not divide: embedding {n_embd}, heads {n_head}, kv heads {n_head_kv}"
            )));
        }
        let head_dim = g
            .u64_opt(&k("attention.key_length"))?
            .map_or(n_embd / n_head, |v| v as usize);
        if head_dim == 0 || head_dim % 8 != 0 || head_dim * n_head != n_embd {
            return Err(GgufError::Invalid(format!(
                "head dimension {head_dim} must be a multiple of 8 with heads x head_dim = embedding ({n_embd})"
            )));
        }
        let tok = g.tensor("token_embd.weight")?;
        let vocab = tok.dims.get(1).copied().unwrap_or(0) as usize;
        let cfg = LlamaConfig {
            n_layer: g.u64(&k("block_count"))? as usize,
            n_embd,
            n_head,
            n_head_kv,
            head_dim,
            n_ff: g.u64(&k("feed_forward_length"))? as usize,
            rms_eps: g
                .f64_opt(&k("attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-5) as f32,
            rope_base: g.f64_opt(&k("rope.freq_base"))?.unwrap_or(10_000.0) as f32,
            ctx_len: g.u64(&k("context_length"))? as usize,
            vocab,
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
            || !finite_pos(cfg.rope_base)
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
}

/// One transformer block.
pub struct Layer {
    /// RMSNorm weight before attention.
    pub attn_norm: Vec<f32>,
    /// Query projection (`n_embd` rows).
    pub wq: QMatrix,
    /// Key projection (`kv_dim` rows).
    pub wk: QMatrix,
    /// Value projection (`kv_dim` rows).
    pub wv: QMatrix,
    /// Attention output projection.
    pub wo: QMatrix,
    /// RMSNorm weight before the FFN.
    pub ffn_norm: Vec<f32>,
    /// SwiGLU gate.
    pub w_gate: QMatrix,
    /// SwiGLU up.
    pub w_up: QMatrix,
    /// FFN down projection.
    pub w_down: QMatrix,
}

/// All weights of a Llama-family model, in kernel layouts.
pub struct LlamaWeights {
    /// Token embedding, one row per token id (also the output head when tied).
    pub tok_embd: QMatrix,
    /// Transformer blocks.
    pub layers: Vec<Layer>,
    /// Final RMSNorm weight.
    pub output_norm: Vec<f32>,
    /// Separate output head; `None` when tied to the embedding.
    pub output: Option<QMatrix>,
}

impl LlamaWeights {
    /// Loads every tensor, zero-copy where the file's layout is a kernel layout.
    pub fn load(g: &GgufFile, cfg: &LlamaConfig) -> Result<LlamaWeights, GgufError> {
        let (d, kvd, ff) = (cfg.n_embd, cfg.kv_dim(), cfg.n_ff);
        let tok_embd = matrix(g, "token_embd.weight", cfg.vocab, d)?;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}");
            layers.push(Layer {
                attn_norm: vector(g, &n("attn_norm.weight"), d)?,
                wq: matrix(g, &n("attn_q.weight"), d, d)?,
                wk: matrix(g, &n("attn_k.weight"), kvd, d)?,
                wv: matrix(g, &n("attn_v.weight"), kvd, d)?,
                wo: matrix(g, &n("attn_output.weight"), d, d)?,
                ffn_norm: vector(g, &n("ffn_norm.weight"), d)?,
                w_gate: matrix(g, &n("ffn_gate.weight"), ff, d)?,
                w_up: matrix(g, &n("ffn_up.weight"), ff, d)?,
                w_down: matrix(g, &n("ffn_down.weight"), d, ff)?,
            });
        }
        let output = if g.has_tensor("output.weight") {
            Some(matrix(g, "output.weight", cfg.vocab, d)?)
        } else {
            None
        };
        Ok(LlamaWeights {
            tok_embd,
            layers,
            output_norm: vector(g, "output_norm.weight", d)?,
            output,
        })
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

/// Reads a `rows` x `cols` matrix into a kernel layout.
pub fn matrix(g: &GgufFile, name: &str, rows: usize, cols: usize) -> Result<QMatrix, GgufError> {
    let t = g.tensor(name)?;
    check_shape(t, &[cols as u64, rows as u64])?;
    let bytes = g.tensor_bytes(t);
    let mapped = || Bytes::Mapped {
        map: Arc::clone(g.map()),
        start: t.start,
        len: t.len,
    };
    let data = match t.ty {
        GgmlType::Q4_1 => WData::Q4_1x8(quant::repack_q4_1_x8(bytes, rows, cols)),
        GgmlType::Q8_0 => WData::Q8_0(mapped()),
        GgmlType::Q4_0 => WData::Q4_1x8(quant::repack_q4_1_x8(
            &quant::q4_0_to_q4_1(bytes),
            rows,
            cols,
        )),
        GgmlType::Q4_K => WData::Q4_1x8(quant::repack_q4_1_x8(
            &quant::q4_k_to_q4_1(bytes),
            rows,
            cols,
        )),
        GgmlType::Q6_K => {
            let mut f = vec![0f32; rows * cols];
            quant::dequantize(t.ty, bytes, &mut f);
            WData::Q8_0(Bytes::Owned(quant::quantize_q8_0(&f)))
        }
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            let mut f = vec![0f32; rows * cols];
            quant::dequantize(t.ty, bytes, &mut f);
            WData::F32(f)
        }
    };
    Ok(QMatrix::new(rows, cols, data))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::writer::{W, build};

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
        let err = LlamaConfig::from_gguf(&g).unwrap_err().to_string();
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
        let err = LlamaConfig::from_gguf(&g).unwrap_err().to_string();
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
        let cfg = LlamaConfig::from_gguf(&g).unwrap();
        let err = LlamaWeights::load(&g, &cfg)
            .err()
            .expect("must fail")
            .to_string();
        assert!(err.contains("blk.0.attn_norm.weight"), "{err}");
        assert!(
            vector(&g, "output_norm.weight", 64)
                .unwrap_err()
                .to_string()
                .contains("shape")
        );
    }
}
