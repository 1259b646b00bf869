//! The GPU cost model: how long one step of a flat batch takes on a given
//! accelerator for a given model, as a roofline. Linear layers cost
//! `2 * params` FLOPs per token and attention `4 * layers * q_width` per
//! token per context position; every step reads the weights once and each
//! sequence's KV once. The step takes the larger of compute and memory time
//! plus a fixed overhead (launches, sampling, the scheduler's turn).

use std::time::Duration;

use serde::Deserialize;

/// One accelerator's figures.
#[derive(Clone, Debug, PartialEq, Deserialize)]
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
    /// Device memory, bytes (weights + KV cache + 10% headroom).
    pub mem_bytes: f64,
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
        };
        Some(match name {
            "h100" => gpu("h100", 989e12, 3.35e12, 80.0, 2.0),
            "h200" => gpu("h200", 989e12, 4.8e12, 141.0, 2.0),
            "a100" => gpu("a100", 312e12, 2.039e12, 80.0, 3.0),
            // Fitted to `flotilla bench-model --no-peer --threads 2 --reps 2`
            // on this machine (2 vCPU, SmolLM2-135M Q4_1, 2026-12-03 07:51
            // UTC): pp512 663.7 tok/s gives (2 * 1.35e8 + attention) * 512
            // FLOP in 0.771 s = 1.9e11 FLOP/s on prefill; decode batch 32
            // (ctx ~192) 359.6 tok/s gives 9.07e9 FLOP per 89 ms step =
            // 1.02e11 on decode batches; tg128 276.8 tok/s is memory-bound:
            // 2.7e10 B/s with 0.3 ms per step gives 251 (-9%); the batched
            // bench's batch-1 figure, 207.1, is 18% below the model (its
            // driver does more per step). KV cache as `serve` sizes it by
            // default (10% of 24 GiB).
            "cpu" => GpuParams {
                name: "cpu".into(),
                prefill_flops: 1.9e11,
                decode_flops: 1.02e11,
                mem_bw: 2.7e10,
                overhead_s: 0.0003,
                mem_bytes: 98e6 + 2.58e9,
            },
            _ => return None,
        })
    }
}

/// The model's shape, as far as cost goes.
#[derive(Clone, Debug, PartialEq, Deserialize)]
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
    /// Bytes per KV element (2 for f16, 1 for int8).
    pub kv_bytes: usize,
    /// Vocabulary size (token ids are drawn below it).
    pub vocab: usize,
    /// Longest sequence.
    pub ctx_len: usize,
}

impl ModelShape {
    /// `llama-7b` (Llama 2 7B, MHA), `llama3-8b` (GQA 8 KV heads),
    /// `smollm2-135m` (the default model, Q4_1).
    pub fn preset(name: &str) -> Option<ModelShape> {
        Some(match name {
            "llama-7b" => ModelShape {
                name: name.into(),
                params: 6.74e9,
                weight_bytes_per_param: 2.0,
                n_layer: 32,
                q_width: 4096,
                n_head_kv: 32,
                head_dim: 128,
                kv_bytes: 2,
                vocab: 32_000,
                ctx_len: 4096,
            },
            "llama3-8b" => ModelShape {
                name: name.into(),
                params: 8.03e9,
                weight_bytes_per_param: 2.0,
                n_layer: 32,
                q_width: 4096,
                n_head_kv: 8,
                head_dim: 128,
                kv_bytes: 2,
                vocab: 128_256,
                ctx_len: 8192,
            },
            "smollm2-135m" => ModelShape {
                name: name.into(),
                params: 1.35e8,
                weight_bytes_per_param: 98e6 / 1.35e8,
                n_layer: 30,
                q_width: 576,
                n_head_kv: 3,
                head_dim: 64,
                kv_bytes: 2,
                vocab: 49_152,
                ctx_len: 8192,
            },
            _ => return None,
        })
    }

    /// Bytes of weights.
    pub fn weight_bytes(&self) -> f64 {
        self.params * self.weight_bytes_per_param
    }

    /// KV bytes per token (all layers, K and V).
    pub fn kv_bytes_per_token(&self) -> usize {
        2 * self.n_layer * self.n_head_kv * self.head_dim * self.kv_bytes
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

/// The time of one step.
pub fn step_time(gpu: &GpuParams, m: &ModelShape, batch: &[SeqCost]) -> Duration {
    let mut prefill_flops = 0.0;
    let mut decode_flops = 0.0;
    let mut kv_read = 0.0;
    for s in batch {
        let n = s.tokens as f64;
        // Attention over positions 0..=p for each new token at p.
        let ctx_sum = n * s.start_pos as f64 + n * (n + 1.0) / 2.0;
        let flops = 2.0 * m.params * n + 4.0 * (m.n_layer * m.q_width) as f64 * ctx_sum;
        if s.tokens > 1 {
            prefill_flops += flops;
        } else {
            decode_flops += flops;
        }
        kv_read += ((s.start_pos + s.tokens) * m.kv_bytes_per_token()) as f64;
    }
    let compute = prefill_flops / gpu.prefill_flops + decode_flops / gpu.decode_flops;
    let memory = (m.weight_bytes() + kv_read) / gpu.mem_bw;
    Duration::from_secs_f64(gpu.overhead_s + compute.max(memory))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(d: Duration) -> f64 {
        d.as_secs_f64() * 1e3
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

    #[test]
    fn the_cpu_fit_reproduces_its_measurements() {
        let (g, m) = (
            GpuParams::preset("cpu").unwrap(),
            ModelShape::preset("smollm2-135m").unwrap(),
        );
        // pp512: 663.7 tok/s measured.
        let pp = 512.0
            / step_time(
                &g,
                &m,
                &[SeqCost {
                    start_pos: 0,
                    tokens: 512,
                }],
            )
            .as_secs_f64();
        assert!((pp / 663.7 - 1.0).abs() < 0.15, "{pp}");
        // tg128 at batch 1: 276.8 tok/s measured (context ~64).
        let tg = 1.0
            / step_time(
                &g,
                &m,
                &[SeqCost {
                    start_pos: 64,
                    tokens: 1,
                }],
            )
            .as_secs_f64();
        assert!((tg / 276.8 - 1.0).abs() < 0.15, "{tg}");
        // Decode at batch 8 (context ~192): 392.2 tok/s measured.
        let b: Vec<SeqCost> = (0..8)
            .map(|_| SeqCost {
                start_pos: 192,
                tokens: 1,
            })
            .collect();
        let b8 = 8.0 / step_time(&g, &m, &b).as_secs_f64();
        assert!((b8 / 392.2 - 1.0).abs() < 0.15, "{b8}");
        // Decode at batch 32: 359.6 tok/s measured.
        let b: Vec<SeqCost> = (0..32)
            .map(|_| SeqCost {
                start_pos: 192,
                tokens: 1,
            })
            .collect();
        let b32 = 32.0 / step_time(&g, &m, &b).as_secs_f64();
        assert!((b32 / 359.6 - 1.0).abs() < 0.15, "{b32}");
    }
}
