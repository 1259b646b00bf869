//! The GPU cost model: how long one step of a flat batch takes on a given
//! accelerator for a given model, as a roofline. Linear layers cost
//! `2 * params` FLOPs per token and attention `4 * layers * q_width` per
//! token per context position; every step reads the weights once and each
//! sequence's KV once. Linear layers run at the prefill rate when the step
//! holds a prefill chunk (its decode tokens ride in the same matrix
//! products) and at the decode rate otherwise; attention has rates of its
//! own for prefill chunks and for decode tokens. The step takes the larger
//! of compute and memory time (GPUs overlap them) or their sum (this CPU
//! backend does not), plus a fixed overhead (launches, sampling, the
//! scheduler's turn). Constrained samples need a token mask each, computed
//! on the host while the step runs: the step takes at least their time on
//! a GPU, and on the CPU backend (the host is the device) it adds up.

use std::time::Duration;

use flotilla_exec::KvDtype;
use serde::{Deserialize, Serialize};

/// One accelerator's figures.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct GpuParams {
    /// Preset name, or a label for a custom set.
    pub name: String,
    /// Sustained FLOP/s on prefill (large GEMMs).
    pub prefill_flops: f64,
    /// Sustained FLOP/s on decode-shaped batches (thin GEMMs).
    pub decode_flops: f64,
    /// Sustained memory bandwidth, bytes/s.
    pub mem_bw: f64,
    /// Fixed cost of every step, seconds.
    pub overhead_s: f64,
    /// Attention FLOP/s in prefill chunks (default: `prefill_flops`).
    #[serde(default)]
    pub attn_prefill_flops: Option<f64>,
    /// Attention FLOP/s for decode tokens (default: `decode_flops`).
    #[serde(default)]
    pub attn_decode_flops: Option<f64>,
    /// Compute and memory traffic overlap (the step takes the larger);
    /// otherwise they add up.
    #[serde(default = "overlapped")]
    pub overlap: bool,
    /// Device memory, bytes (weights + KV cache + 10% headroom).
    pub mem_bytes: f64,
    /// Host time to compute one constrained sample's token mask, us
    /// (llguidance over SmolLM2's 49,152 tokens, 22 JSON schemas: p50 0.7,
    /// p99 43, mean ~5; docs/BENCHMARKS.md "Issue 23").
    #[serde(default = "default_mask_us")]
    pub mask_us: f64,
    /// Bytes/s between device memory and the KV offload tier in host
    /// memory (PCIe; for the CPU backend, a memory copy).
    #[serde(default = "default_host_link_bw")]
    pub host_link_bw: f64,
}

fn default_mask_us() -> f64 {
    5.0
}

/// Sustained PCIe 4.0 x16 transfers of whole KV blocks (of 32 GB/s peak).
fn default_host_link_bw() -> f64 {
    2.5e10
}

impl GpuParams {
    /// A named preset: `h100`, `h200`, `a100`, `cpu` (this machine's CPU
    /// backend, 2 threads).
    pub fn preset(name: &str) -> Option<GpuParams> {
        // Datasheet peaks: dense BF16 tensor FLOP/s and HBM bandwidth.
        // Sustained: 60% of peak on prefill GEMMs, 40% on decode-shaped
        // ones, 80% of bandwidth (what vLLM-class engines reach).
        let gpu = |name: &str, peak: f64, bw: f64, mem_gb: f64, overhead_ms: f64| GpuParams {
            name: name.into(),
            prefill_flops: peak * 0.6,
            decode_flops: peak * 0.4,
            mem_bw: bw * 0.8,
            overhead_s: overhead_ms / 1e3,
            mem_bytes: mem_gb * 1e9,
            attn_prefill_flops: None,
            attn_decode_flops: None,
            overlap: true,
            mask_us: default_mask_us(),
            host_link_bw: default_host_link_bw(),
        };
        Some(match name {
            "h100" => gpu("h100", 989e12, 3.35e12, 80.0, 2.0),
            "h200" => gpu("h200", 989e12, 4.8e12, 141.0, 2.0),
            "a100" => gpu("a100", 312e12, 2.039e12, 80.0, 3.0),
            // Fitted to medians of three runs each of `flotilla bench-model
            // --no-peer --threads 2` on this machine (2 vCPU, SmolLM2-135M
            // Q4_1, 2026-12-03 10:30 UTC): `--pp N --reps 3` for N = 32,
            // 64, 150, 300, 512 gave 914, 925, 1048, 939, 779 tok/s;
            // `--tg 64 --batches 1,4,8,16,32 --batch-prompt 150
            // --batch-gen 32` gave tg64 202 and batches 175, 292, 382,
            // 390, 420 tok/s. This backend does not overlap streaming the
            // weights (98 MB at 3.0e10 B/s: 3.3 ms a step, what the batch-1
            // figures leave once compute is counted) with compute, so the
            // two add up. Prefill: 2.9e11 FLOP/s on the linear layers,
            // attention 6.3e10 (pp512 vs pp300). Decode: batch 1 at context
            // ~166 vs ~40 costs 6.1 us more per position per token, 0.85 of
            // it reading KV: attention runs at 1.3e10; batch 8 (20.9 ms a
            // step) leaves 1.13 ms a token for the linear layers, 2.4e11
            // FLOP/s. The model gives pp32..512 and decode batches 1..32
            // within 15% of those medians (`the_cpu_fit_reproduces_its_measurements`).
            // Step times are whole-step figures: the simulated GpuWorker
            // carries sub-millisecond remainders instead of rounding each
            // step up to tokio's millisecond timer.
            // KV cache as `serve` sizes it by default (10% of 24 GiB).
            "cpu" => GpuParams {
                name: "cpu".into(),
                prefill_flops: 2.9e11,
                decode_flops: 2.4e11,
                mem_bw: 3.0e10,
                overhead_s: 0.0003,
                mem_bytes: 98e6 + 2.58e9,
                attn_prefill_flops: Some(6.3e10),
                attn_decode_flops: Some(1.3e10),
                overlap: false,
                mask_us: default_mask_us(),
                // A block's copy between two regions of host memory.
                host_link_bw: 1.0e10,
            },
            _ => return None,
        })
    }
}

fn overlapped() -> bool {
    true
}

/// The model's shape, as far as cost goes.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModelShape {
    /// Preset name, or a label.
    pub name: String,
    /// Parameters.
    pub params: f64,
    /// Bytes per weight (2 for bf16, ~0.6 for Q4).
    pub weight_bytes_per_param: f64,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Query heads x head dimension.
    pub q_width: usize,
    /// KV heads.
    pub n_head_kv: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Element type of the KV cache: the scenario's `[engine]
    /// kv_cache_dtype`, not a model field.
    #[serde(skip)]
    pub kv_dtype: KvDtype,
    /// Vocabulary size (token ids are drawn below it).
    pub vocab: usize,
    /// Longest sequence.
    pub ctx_len: usize,
    /// Sliding window of the windowed layers, in tokens (0: none).
    #[serde(default)]
    pub window: usize,
    /// Layers that attend within `window` only (Gemma 3: 5 of every 6).
    #[serde(default)]
    pub window_layers: usize,
}

impl ModelShape {
    /// The presets' names.
    pub const PRESETS: [&str; 6] = [
        "llama-7b",
        "llama-1b",
        "llama3-8b",
        "llama3-1b",
        "smollm2-135m",
        "gemma3-270m",
    ];

    /// `llama-7b` (Llama 2 7B, MHA), `llama-1b` (TinyLlama 1.1B: Llama
    /// 2's tokenizer, a draft model for it), `llama3-8b` (GQA 8 KV heads),
    /// `llama3-1b` (Llama 3.2 1B: Llama 3's tokenizer, a draft for it),
    /// `smollm2-135m` (the default model, Q4_1), `gemma3-270m`.
    pub fn preset(name: &str) -> Option<ModelShape> {
        Some(match name {
            "llama-1b" => ModelShape {
                name: name.into(),
                params: 1.1e9,
                weight_bytes_per_param: 2.0,
                n_layer: 22,
                q_width: 2048,
                n_head_kv: 4,
                head_dim: 64,
                kv_dtype: KvDtype::F16,
                vocab: 32_000,
                ctx_len: 2048,
                window: 0,
                window_layers: 0,
            },
            "llama-7b" => ModelShape {
                name: name.into(),
                params: 6.74e9,
                weight_bytes_per_param: 2.0,
                n_layer: 32,
                q_width: 4096,
                n_head_kv: 32,
                head_dim: 128,
                kv_dtype: KvDtype::F16,
                vocab: 32_000,
                ctx_len: 4096,
                window: 0,
                window_layers: 0,
            },
            "llama3-1b" => ModelShape {
                name: name.into(),
                params: 1.24e9,
                weight_bytes_per_param: 2.0,
                n_layer: 16,
                q_width: 2048,
                n_head_kv: 8,
                head_dim: 64,
                kv_dtype: KvDtype::F16,
                vocab: 128_256,
                ctx_len: 8192,
                window: 0,
                window_layers: 0,
            },
            "llama3-8b" => ModelShape {
                name: name.into(),
                params: 8.03e9,
                weight_bytes_per_param: 2.0,
                n_layer: 32,
                q_width: 4096,
                n_head_kv: 8,
                head_dim: 128,
                kv_dtype: KvDtype::F16,
                vocab: 128_256,
                ctx_len: 8192,
                window: 0,
                window_layers: 0,
            },
            "smollm2-135m" => ModelShape {
                name: name.into(),
                params: 1.35e8,
                weight_bytes_per_param: 98e6 / 1.35e8,
                n_layer: 30,
                q_width: 576,
                n_head_kv: 3,
                head_dim: 64,
                kv_dtype: KvDtype::F16,
                vocab: 49_152,
                ctx_len: 8192,
                window: 0,
                window_layers: 0,
            },
            // Gemma 3 270M, Q4_K_M (253 MB): 18 layers, 15 of them with a
            // 512-token window; 4 query heads of 256 over one KV head; a
            // 262,144-token tied head (168M of the 268M parameters).
            "gemma3-270m" => ModelShape {
                name: name.into(),
                params: 2.68e8,
                weight_bytes_per_param: 253e6 / 2.68e8,
                n_layer: 18,
                q_width: 1024,
                n_head_kv: 1,
                head_dim: 256,
                kv_dtype: KvDtype::F16,
                vocab: 262_144,
                ctx_len: 32_768,
                window: 512,
                window_layers: 15,
            },
            _ => return None,
        })
    }

    /// Bytes of weights.
    pub fn weight_bytes(&self) -> f64 {
        self.params * self.weight_bytes_per_param
    }

    /// KV bytes per token (all layers, K and V; int8 with its scales):
    /// what a transfer moves and what attention reads.
    pub fn kv_bytes_per_token(&self) -> usize {
        2 * self.n_layer * self.n_head_kv * self.kv_dtype.row_bytes(self.head_dim)
    }

    /// Layers that attend over every position.
    fn global_layers(&self) -> usize {
        self.n_layer - self.window_layers.min(self.n_layer)
    }

    /// Positions a token at `p` attends to, summed over the layers.
    fn attended(&self, p: f64) -> f64 {
        let windowed = if self.window > 0 {
            p.min(self.window as f64)
        } else {
            p
        };
        self.global_layers() as f64 * p + self.window_layers.min(self.n_layer) as f64 * windowed
    }
}

/// One sequence's part of a step, for costing.
#[derive(Clone, Copy, Debug)]
pub struct SeqCost {
    /// Positions already in the cache.
    pub start_pos: usize,
    /// Tokens computed now.
    pub tokens: usize,
}

/// What one step costs before any rate divides it: FLOPs of the linear
/// layers and of attention, bytes read.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTerms {
    /// FLOPs of the linear layers (`2 * params` a token).
    pub linear: f64,
    /// Whether a sequence computes more than one token (a prefill chunk):
    /// the linear layers run at the prefill rate.
    pub prefill: bool,
    /// Attention FLOPs of the prefill chunks.
    pub attn_prefill: f64,
    /// Attention FLOPs of the one-token sequences.
    pub attn_decode: f64,
    /// Bytes read: the weights once, each sequence's KV once.
    pub bytes: f64,
}

impl StepTerms {
    /// The terms of `batch` for model `m`.
    pub fn of(m: &ModelShape, batch: &[SeqCost]) -> StepTerms {
        let mut t = StepTerms {
            bytes: m.weight_bytes(),
            ..StepTerms::default()
        };
        for s in batch {
            let n = s.tokens as f64;
            t.linear += 2.0 * m.params * n;
            // Attention over positions 0..=p (or the window) for each new token at p.
            let ctx_sum: f64 = if m.window > 0 && m.window_layers > 0 {
                (s.start_pos..s.start_pos + s.tokens)
                    .map(|p| m.attended(p as f64 + 1.0))
                    .sum()
            } else {
                m.n_layer as f64 * (n * s.start_pos as f64 + n * (n + 1.0) / 2.0)
            };
            let attn = 4.0 * m.q_width as f64 * ctx_sum;
            if s.tokens > 1 {
                t.prefill = true;
                t.attn_prefill += attn;
            } else {
                t.attn_decode += attn;
            }
            // Windowed layers read only the blocks inside their window.
            t.bytes += m.attended((s.start_pos + s.tokens) as f64) * m.kv_bytes_per_token() as f64
                / m.n_layer as f64;
        }
        t
    }
}

/// The steps `flotilla bench-model --fit` times to fit a CPU backend's
/// figures: prompt chunks of 32..512 tokens at depths 0..1024 (the linear
/// layers' prefill rate and prefill attention), and decode batches of 1..32
/// sequences at contexts 128..1024 (the decode rate and decode attention).
pub fn fit_steps() -> Vec<Vec<SeqCost>> {
    let mut out = Vec::new();
    for (tokens, start_pos) in [
        (32, 0),
        (64, 0),
        (128, 0),
        (256, 0),
        (512, 0),
        (128, 512),
        (128, 1024),
        (512, 512),
    ] {
        out.push(vec![SeqCost { start_pos, tokens }]);
    }
    for (batch, ctx) in [
        (1, 128),
        (2, 128),
        (4, 128),
        (8, 128),
        (16, 128),
        (32, 128),
        (1, 1024),
        (4, 512),
        (8, 1024),
    ] {
        out.push(vec![
            SeqCost {
                start_pos: ctx,
                tokens: 1,
            };
            batch
        ]);
    }
    out
}

/// A CPU backend's figures (compute and memory traffic add up) fitted to
/// measured step times: `mem_bw` is measured apart (it and the fixed
/// overhead are both a constant per step, which step times alone cannot
/// tell apart); the overhead and the four FLOP rates are the non-negative
/// least-squares fit of the relative errors. Each step of `steps` must
/// hold one kind (prefill chunks or decode tokens). `mem_bytes` is what
/// the simulated node holds (weights + KV cache + 10% headroom).
pub fn fit_unoverlapped(
    name: &str,
    m: &ModelShape,
    steps: &[(Vec<SeqCost>, f64)],
    mem_bw: f64,
    mem_bytes: f64,
) -> Result<GpuParams, String> {
    if !(mem_bw.is_finite() && mem_bw > 0.0) {
        return Err(format!("memory bandwidth {mem_bw} B/s is not positive"));
    }
    // Unknowns: overhead, 1/prefill, 1/decode, 1/attn prefill, 1/attn decode.
    let mut rows: Vec<([f64; 5], f64)> = Vec::new();
    for (batch, secs) in steps {
        if !(secs.is_finite() && *secs > 0.0) {
            return Err(format!("a step time of {secs} s is not positive"));
        }
        let t = StepTerms::of(m, batch);
        let (lp, ld) = if t.prefill {
            (t.linear, 0.0)
        } else {
            (0.0, t.linear)
        };
        // Relative error: each row divided by its measured time.
        let rest = secs - t.bytes / mem_bw;
        rows.push((
            [1.0, lp, ld, t.attn_prefill, t.attn_decode].map(|x| x / secs),
            rest / secs,
        ));
    }
    // Columns scaled to a largest entry of 1, so the unknowns are of one size.
    let mut scale = [0.0f64; 5];
    for (a, _) in &rows {
        for j in 0..5 {
            scale[j] = scale[j].max(a[j]);
        }
    }
    if let Some(j) = (0..5).find(|&j| scale[j] == 0.0) {
        return Err(format!(
            "the steps do not exercise term {j} of the cost model (prefill, decode and both \
             attentions each need steps)"
        ));
    }
    let mut h = [[0.0f64; 5]; 5];
    let mut g = [0.0f64; 5];
    for (a, b) in &rows {
        let a: [f64; 5] = std::array::from_fn(|j| a[j] / scale[j]);
        for i in 0..5 {
            g[i] += a[i] * b;
            for j in 0..5 {
                h[i][j] += a[i] * a[j];
            }
        }
    }
    // Non-negative least squares by projected coordinate descent (a convex
    // problem of five unknowns: it converges).
    let mut x = [0.0f64; 5];
    for _ in 0..20_000 {
        let mut moved = 0.0f64;
        for i in 0..5 {
            let grad: f64 = (0..5).map(|j| h[i][j] * x[j]).sum::<f64>() - g[i];
            let next = (x[i] - grad / h[i][i]).max(0.0);
            moved = moved.max((next - x[i]).abs());
            x[i] = next;
        }
        if moved < 1e-13 {
            break;
        }
    }
    let x: [f64; 5] = std::array::from_fn(|j| x[j] / scale[j]);
    // A term the fit finds free costs nothing: a rate beyond any machine.
    let rate = |inv: f64| if inv > 1e-18 { 1.0 / inv } else { 1e18 };
    Ok(GpuParams {
        name: name.into(),
        prefill_flops: rate(x[1]),
        decode_flops: rate(x[2]),
        mem_bw,
        overhead_s: x[0],
        attn_prefill_flops: Some(rate(x[3])),
        attn_decode_flops: Some(rate(x[4])),
        overlap: false,
        mem_bytes,
        mask_us: default_mask_us(),
        host_link_bw: 1.0e10,
    })
}

/// The time of one step.
pub fn step_time(gpu: &GpuParams, m: &ModelShape, batch: &[SeqCost]) -> Duration {
    step_time_masked(gpu, m, batch, 0)
}

/// The time of one step of which `masks` samples are constrained: their
/// masks are computed on the host while the device runs (the step takes
/// the longer of the two), or, where the host is the device (`overlap`
/// off: the CPU backend), after it.
pub fn step_time_masked(
    gpu: &GpuParams,
    m: &ModelShape,
    batch: &[SeqCost],
    masks: usize,
) -> Duration {
    let t = StepTerms::of(m, batch);
    let linear_rate = if t.prefill {
        gpu.prefill_flops
    } else {
        gpu.decode_flops
    };
    let compute = t.linear / linear_rate
        + t.attn_prefill / gpu.attn_prefill_flops.unwrap_or(gpu.prefill_flops)
        + t.attn_decode / gpu.attn_decode_flops.unwrap_or(gpu.decode_flops);
    let memory = t.bytes / gpu.mem_bw;
    let masking = masks as f64 * gpu.mask_us * 1e-6;
    let busy = if gpu.overlap {
        compute.max(memory).max(masking)
    } else {
        compute + memory + masking
    };
    Duration::from_secs_f64(gpu.overhead_s + busy)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(d: Duration) -> f64 {
        d.as_secs_f64() * 1e3
    }

    #[test]
    fn masks_hide_behind_a_gpu_step_and_add_to_a_cpu_one() {
        let m = ModelShape::preset("smollm2-135m").unwrap();
        let batch: Vec<SeqCost> = (0..32)
            .map(|_| SeqCost {
                start_pos: 200,
                tokens: 1,
            })
            .collect();
        let cpu = GpuParams::preset("cpu").unwrap();
        let (plain, masked) = (
            step_time(&cpu, &m, &batch),
            step_time_masked(&cpu, &m, &batch, 32),
        );
        let added = (masked - plain).as_secs_f64() * 1e6;
        assert!((added - 32.0 * cpu.mask_us).abs() < 1.0, "{added} us");
        // An H200 decode step of a 7B model reads 13.5 GB of weights
        // (~3.5 ms busy, 2 ms overhead): 32 masks of 5 us hide inside it,
        // 32 of 500 us do not.
        let m = ModelShape::preset("llama-7b").unwrap();
        let mut h200 = GpuParams::preset("h200").unwrap();
        assert_eq!(
            step_time(&h200, &m, &batch),
            step_time_masked(&h200, &m, &batch, 32)
        );
        h200.mask_us = 500.0;
        let slow = ms(step_time_masked(&h200, &m, &batch, 32));
        assert!((slow - (2.0 + 16.0)).abs() < 0.01, "{slow}");
    }

    #[test]
    fn decode_is_memory_bound_and_prefill_compute_bound_on_an_h200() {
        let (g, m) = (
            GpuParams::preset("h200").unwrap(),
            ModelShape::preset("llama-7b").unwrap(),
        );
        // One decode token: the 13.5 GB of weights at 3.84 TB/s, ~3.5 ms + 2 ms.
        let one = ms(step_time(
            &g,
            &m,
            &[SeqCost {
                start_pos: 100,
                tokens: 1,
            }],
        ));
        assert!((5.0..6.5).contains(&one), "{one}");
        // 60 short decodes cost little more than one: the weights are read
        // once per step (at long contexts the KV reads take over).
        let sixty: Vec<SeqCost> = (0..60)
            .map(|_| SeqCost {
                start_pos: 100,
                tokens: 1,
            })
            .collect();
        let batch = ms(step_time(&g, &m, &sixty));
        assert!(batch < one * 1.6, "{batch} vs {one}");
        // A 2,000-token prefill is compute-bound: ~27 TFLOP at 593 TFLOP/s.
        let pf = ms(step_time(
            &g,
            &m,
            &[SeqCost {
                start_pos: 0,
                tokens: 2000,
            }],
        ));
        assert!((40.0..60.0).contains(&pf), "{pf}");
    }

    /// An int8 cache moves and reads 17/32 of f16's bytes per token (the
    /// values, and an f16 scale per 32), so long-context decode steps,
    /// whose time the KV reads dominate, get cheaper.
    #[test]
    fn an_int8_cache_moves_and_reads_fewer_bytes() {
        let g = GpuParams::preset("h200").unwrap();
        let f16 = ModelShape::preset("llama-7b").unwrap();
        let int8 = ModelShape {
            kv_dtype: KvDtype::Int8,
            ..f16.clone()
        };
        assert_eq!(f16.kv_bytes_per_token(), 2 * 32 * 32 * 128 * 2);
        assert_eq!(
            int8.kv_bytes_per_token() * 32,
            f16.kv_bytes_per_token() * 17
        );
        let long: Vec<SeqCost> = (0..64)
            .map(|_| SeqCost {
                start_pos: 4000,
                tokens: 1,
            })
            .collect();
        let (a, b) = (
            ms(step_time(&g, &f16, &long)),
            ms(step_time(&g, &int8, &long)),
        );
        assert!(b < a * 0.75, "int8 {b} ms vs f16 {a} ms");
    }

    #[test]
    fn sliding_window_layers_cost_only_their_window() {
        let g = GpuParams::preset("h200").unwrap();
        let swa = ModelShape::preset("gemma3-270m").unwrap();
        let full = ModelShape {
            window: 0,
            window_layers: 0,
            ..swa.clone()
        };
        let at = |m: &ModelShape, p: usize, n: usize| {
            ms(step_time(
                &g,
                m,
                &[SeqCost {
                    start_pos: p,
                    tokens: n,
                }],
            ))
        };
        // Inside the window the two are the same model.
        assert_eq!(at(&swa, 100, 1), at(&full, 100, 1));
        assert_eq!(at(&swa, 0, 400), at(&full, 0, 400));
        // Far past it, 15 of 18 layers read 512 positions instead of 30,000.
        let batch: Vec<SeqCost> = (0..64)
            .map(|_| SeqCost {
                start_pos: 30_000,
                tokens: 1,
            })
            .collect();
        let (a, b) = (
            ms(step_time(&g, &swa, &batch)),
            ms(step_time(&g, &full, &batch)),
        );
        assert!(a < b * 0.5, "windowed {a} ms vs full {b} ms");
    }

    #[test]
    fn a_fit_to_step_times_recovers_the_figures_that_made_them() {
        let m = ModelShape::preset("smollm2-135m").unwrap();
        let cpu = GpuParams::preset("cpu").unwrap();
        // The times the preset gives each fit step.
        let steps: Vec<(Vec<SeqCost>, f64)> = fit_steps()
            .into_iter()
            .map(|b| {
                let t = step_time(&cpu, &m, &b).as_secs_f64();
                (b, t)
            })
            .collect();
        let fit = fit_unoverlapped("fitted", &m, &steps, cpu.mem_bw, cpu.mem_bytes).unwrap();
        let near = |a: f64, b: f64| (a / b - 1.0).abs() < 0.01;
        assert!(near(fit.prefill_flops, cpu.prefill_flops), "{fit:?}");
        assert!(near(fit.decode_flops, cpu.decode_flops), "{fit:?}");
        assert!(near(fit.attn_prefill_flops.unwrap(), 6.3e10), "{fit:?}");
        assert!(near(fit.attn_decode_flops.unwrap(), 1.3e10), "{fit:?}");
        assert!((fit.overhead_s - cpu.overhead_s).abs() < 5e-6, "{fit:?}");
        // With noise the fit still gives every step within the noise.
        let noisy: Vec<(Vec<SeqCost>, f64)> = steps
            .iter()
            .enumerate()
            .map(|(i, (b, t))| (b.clone(), t * if i % 2 == 0 { 1.03 } else { 0.97 }))
            .collect();
        let fit = fit_unoverlapped("fitted", &m, &noisy, cpu.mem_bw, cpu.mem_bytes).unwrap();
        for (b, t) in &noisy {
            let p = step_time(&fit, &m, b).as_secs_f64();
            assert!((p / t - 1.0).abs() < 0.07, "{b:?}: {p} vs {t}");
        }
        // Steps without decode tokens cannot fit the decode rate.
        let prefill_only: Vec<_> = steps
            .iter()
            .filter(|(b, _)| b[0].tokens > 1)
            .cloned()
            .collect();
        let e = fit_unoverlapped("x", &m, &prefill_only, cpu.mem_bw, cpu.mem_bytes).unwrap_err();
        assert!(e.contains("do not exercise"), "{e}");
    }

    #[test]
    fn the_cpu_fit_reproduces_its_measurements() {
        let (g, m) = (
            GpuParams::preset("cpu").unwrap(),
            ModelShape::preset("smollm2-135m").unwrap(),
        );
        // Prefill of one prompt of n tokens: the medians of the fit.
        for (n, measured) in [
            (32, 914.5),
            (64, 925.4),
            (150, 1047.7),
            (300, 939.1),
            (512, 778.8),
        ] {
            let t = step_time(
                &g,
                &m,
                &[SeqCost {
                    start_pos: 0,
                    tokens: n,
                }],
            );
            let tok_s = n as f64 / t.as_secs_f64();
            assert!(
                (tok_s / measured - 1.0).abs() < 0.15,
                "pp{n}: {tok_s} vs {measured}"
            );
        }
        // Decode at batch b, context ~166 (150-token prompts, 32 tokens).
        for (b, measured) in [(1, 174.5), (4, 291.8), (8, 381.8), (16, 390.2), (32, 419.7)] {
            let batch: Vec<SeqCost> = (0..b)
                .map(|_| SeqCost {
                    start_pos: 166,
                    tokens: 1,
                })
                .collect();
            let tok_s = b as f64 / step_time(&g, &m, &batch).as_secs_f64();
            assert!(
                (tok_s / measured - 1.0).abs() < 0.15,
                "batch {b}: {tok_s} vs {measured}"
            );
        }
        // tg64 at batch 1, context ~40: 201.8 tok/s.
        let tg = 1.0
            / step_time(
                &g,
                &m,
                &[SeqCost {
                    start_pos: 40,
                    tokens: 1,
                }],
            )
            .as_secs_f64();
        assert!((tg / 201.8 - 1.0).abs() < 0.15, "{tg}");
    }
}
