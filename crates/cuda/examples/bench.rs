//! Prefill and decode speed of the CUDA executor on the default model (or
//! `--model FILE`), beside the memory-bandwidth bound of a decode step:
//!
//!   cargo run --release -p flotilla-cuda --example bench -- \
//!       [--model FILE] [--bandwidth-gbs 4800] [--kv-cache-dtype f16|int8] \
//!       [--batches 1,8,32,128,256]
//!
//! At each batch size b: prefill of b prompts of 512 tokens (steps of at
//! most 8192 tokens, whole prompts each), then decode of b sequences (a
//! 32-token prompt each, 64 greedy steps picked on the device), each the
//! median of three runs. A decode step reads every weight byte once and
//! every cached K/V row of the batch once: those bytes over the step's time
//! are its achieved bandwidth, printed beside the device's.

use std::path::PathBuf;
use std::time::Instant;

use flotilla_cuda::{CudaConfig, CudaExecutor};
use flotilla_exec::KvDtype;
use flotilla_model::{Executor, OutputKind, SamplingParams, SeqInput, StepOutputs};

const PROMPT: usize = 512;
const STEP_TOKENS: usize = 8192;
const DECODE_PROMPT: usize = 32;
const DECODE_STEPS: usize = 64;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> Res<()> {
    let mut model: Option<PathBuf> = None;
    let mut bw_gbs = 4800.0;
    let mut kv_dtype = KvDtype::F16;
    let mut batches = vec![1usize, 8, 32, 128, 256];
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--model" => model = Some(PathBuf::from(value()?)),
            "--bandwidth-gbs" => bw_gbs = value()?.parse()?,
            "--kv-cache-dtype" => kv_dtype = KvDtype::parse(&value()?)?,
            "--batches" => {
                batches = value()?
                    .split(',')
                    .map(str::parse)
                    .collect::<Result<_, _>>()?
            }
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let max_b = batches.iter().copied().max().unwrap_or(1);
    let path = match model {
        Some(p) => p,
        None => flotilla_hub::ensure_default_model(true)?,
    };
    let cfg = CudaConfig {
        max_batch_tokens: STEP_TOKENS,
        max_seqs: max_b.max(STEP_TOKENS / PROMPT),
        kv_cache_fraction: 0.5,
        kv_dtype,
        ..Default::default()
    };
    let t0 = Instant::now();
    let mut e = CudaExecutor::load(&path, &cfg)?;
    let spec = e.model_spec().clone();
    let kv = e.kv_spec();
    eprintln!(
        "{e:?}: {} layers, {:.1} MB of weights, {} KV blocks of {} bytes ({}), loaded in {:.2} s",
        spec.n_layer,
        spec.weight_bytes as f64 / 1e6,
        kv.num_blocks,
        kv.bytes_per_block,
        kv.dtype.name(),
        t0.elapsed().as_secs_f64()
    );
    let bs = kv.block_size;
    let per_seq = PROMPT.max(DECODE_PROMPT + DECODE_STEPS + 1).div_ceil(bs);
    if max_b * per_seq > kv.num_blocks {
        return Err(format!(
            "batch {max_b} needs {} KV blocks; the cache has {}",
            max_b * per_seq,
            kv.num_blocks
        )
        .into());
    }
    let row_bytes = kv.bytes_per_block as f64 / bs as f64; // one position, all layers, K and V
    let vocab = spec.vocab as u32;
    let greedy = OutputKind::Sample(SamplingParams::greedy());
    let mut out = StepOutputs::default();
    let prompt = |i: usize, n: usize| -> Vec<u32> {
        (0..n)
            .map(|j| ((i * 7919 + j * 104_729) as u32 % (vocab - 10)) + 5)
            .collect()
    };
    let tables: Vec<Vec<u32>> = (0..max_b)
        .map(|i| ((i * per_seq) as u32..((i + 1) * per_seq) as u32).collect())
        .collect();

    // Prefill of b prompts, whole prompts per step.
    let prefill = |b: usize, e: &mut CudaExecutor, out: &mut StepOutputs| -> Res<f64> {
        let prompts: Vec<Vec<u32>> = (0..b).map(|i| prompt(i, PROMPT)).collect();
        let mut runs = Vec::new();
        for r in 0..4 {
            let t = Instant::now();
            for group in (0..b).collect::<Vec<_>>().chunks(STEP_TOKENS / PROMPT) {
                let batch: Vec<SeqInput<'_>> = group
                    .iter()
                    .map(|&i| SeqInput {
                        tokens: &prompts[i],
                        start_pos: 0,
                        block_table: &tables[i],
                        output: greedy,
                        bias: &[],
                        draft_bias: &[],
                        allow: None,
                    })
                    .collect();
                e.step(&batch, out)?;
            }
            if r > 0 {
                runs.push((b * PROMPT) as f64 / t.elapsed().as_secs_f64());
            }
        }
        Ok(median(runs))
    };
    let mut rows = Vec::new();
    for &b in &batches {
        let pp = prefill(b, &mut e, &mut out)?;
        let mut runs = Vec::new();
        for _ in 0..3 {
            let mut toks: Vec<Vec<u32>> = (0..b).map(|i| prompt(i, DECODE_PROMPT)).collect();
            let batch: Vec<SeqInput<'_>> = toks
                .iter()
                .zip(&tables)
                .map(|(t, tb)| SeqInput {
                    tokens: t,
                    start_pos: 0,
                    block_table: tb,
                    output: greedy,
                    bias: &[],
                    draft_bias: &[],
                    allow: None,
                })
                .collect();
            e.step(&batch, &mut out)?;
            let mut next: Vec<u32> = (0..b).map(|i| out.token_of(i).unwrap_or(5)).collect();
            let t = Instant::now();
            for _ in 0..DECODE_STEPS {
                for (tk, n) in toks.iter_mut().zip(&next) {
                    tk.push(*n);
                }
                let batch: Vec<SeqInput<'_>> = toks
                    .iter()
                    .zip(&tables)
                    .map(|(t, tb)| SeqInput {
                        tokens: &t[t.len() - 1..],
                        start_pos: t.len() - 1,
                        block_table: tb,
                        output: greedy,
                        bias: &[],
                        draft_bias: &[],
                        allow: None,
                    })
                    .collect();
                e.step(&batch, &mut out)?;
                next = (0..b).map(|i| out.token_of(i).unwrap_or(5)).collect();
            }
            runs.push(t.elapsed().as_secs_f64());
        }
        let secs = median(runs);
        // Bytes read by the timed steps: the weights each step, and each
        // sequence's cached rows (DECODE_PROMPT + 1 + s at step s).
        let kv_rows: usize = (0..DECODE_STEPS).map(|s| DECODE_PROMPT + 1 + s).sum();
        let bytes =
            DECODE_STEPS as f64 * spec.weight_bytes as f64 + (b * kv_rows) as f64 * row_bytes;
        rows.push((
            b,
            pp,
            (b * DECODE_STEPS) as f64 / secs,
            secs / DECODE_STEPS as f64,
            bytes / secs / 1e9,
        ));
    }
    println!(
        "KV cache {}; weights {:.1} MB; decode bandwidth against {bw_gbs:.0} GB/s",
        kv.dtype.name(),
        spec.weight_bytes as f64 / 1e6
    );
    println!(
        "| batch | prefill tok/s | decode tok/s | decode step ms | achieved GB/s | of {bw_gbs:.0} GB/s |"
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    for (b, pp, tg, step, gbs) in rows {
        println!(
            "| {b} | {pp:.0} | {tg:.0} | {:.3} | {gbs:.0} | {:.1}% |",
            step * 1e3,
            100.0 * gbs / bw_gbs
        );
    }
    Ok(())
}
