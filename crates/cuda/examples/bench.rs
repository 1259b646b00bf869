//! Decode and prefill speed of the CUDA executor on the default model (or
//! `--model FILE`), beside the memory-bandwidth bound of its weights:
//!
//!   cargo run --release -p flotilla-cuda --example bench -- [--model FILE] [--bandwidth-gbs 4800]
//!
//! Decode at batch 1 and 64 (greedy, tokens picked on the device), prefill
//! of one 512-token prompt; each the median of three runs.

use std::path::PathBuf;
use std::time::Instant;

use flotilla_cuda::{CudaConfig, CudaExecutor};
use flotilla_model::{Executor, OutputKind, SamplingParams, SeqInput, StepOutputs};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut model: Option<PathBuf> = None;
    let mut bw_gbs = 4800.0;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--model" => model = args.next().map(PathBuf::from),
            "--bandwidth-gbs" => {
                bw_gbs = args
                    .next()
                    .ok_or("--bandwidth-gbs needs a value")?
                    .parse()?
            }
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let path = match model {
        Some(p) => p,
        None => flotilla_hub::ensure_default_model(true)?,
    };
    let cfg = CudaConfig {
        max_batch_tokens: 2048,
        max_seqs: 64,
        kv_cache_fraction: 0.5,
        ..Default::default()
    };
    let t0 = Instant::now();
    let mut e = CudaExecutor::load(&path, &cfg)?;
    let spec = e.model_spec().clone();
    let kv = e.kv_spec();
    eprintln!(
        "{e:?}: {} layers, {:.1} MB of f16 weights, {} KV blocks, loaded in {:.2} s",
        spec.n_layer,
        spec.weight_bytes as f64 / 1e6,
        kv.num_blocks,
        t0.elapsed().as_secs_f64()
    );
    let vocab = spec.vocab as u32;
    let bs = kv.block_size;
    let greedy = OutputKind::Sample(SamplingParams::greedy());
    let mut out = StepOutputs::default();
    let prompt = |i: usize, n: usize| -> Vec<u32> {
        (0..n)
            .map(|j| ((i * 7919 + j * 104_729) as u32 % (vocab - 10)) + 5)
            .collect()
    };

    // Prefill: one prompt of 512 tokens.
    let mut pp = Vec::new();
    for r in 0..4 {
        let p = prompt(r, 512);
        let table: Vec<u32> = (0..512usize.div_ceil(bs) as u32).collect();
        let t = Instant::now();
        e.step(
            &[SeqInput {
                tokens: &p,
                start_pos: 0,
                block_table: &table,
                output: greedy,
            }],
            &mut out,
        )?;
        if r > 0 {
            pp.push(512.0 / t.elapsed().as_secs_f64());
        }
    }

    // Decode at batch b: a 32-token prompt each, then 64 steps.
    let mut decode = |b: usize| -> Result<f64, Box<dyn std::error::Error>> {
        let mut runs = Vec::new();
        for _ in 0..3 {
            let per = (32 + 64usize).div_ceil(bs);
            let tables: Vec<Vec<u32>> = (0..b)
                .map(|i| ((i * per) as u32..((i + 1) * per) as u32).collect())
                .collect();
            let mut toks: Vec<Vec<u32>> = (0..b).map(|i| prompt(i, 32)).collect();
            let batch: Vec<SeqInput<'_>> = toks
                .iter()
                .zip(&tables)
                .map(|(t, tb)| SeqInput {
                    tokens: t,
                    start_pos: 0,
                    block_table: tb,
                    output: greedy,
                })
                .collect();
            e.step(&batch, &mut out)?;
            let mut next: Vec<u32> = (0..b).map(|i| out.token_of(i).unwrap_or(5)).collect();
            let t = Instant::now();
            for _ in 0..64 {
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
                    })
                    .collect();
                e.step(&batch, &mut out)?;
                next = (0..b).map(|i| out.token_of(i).unwrap_or(5)).collect();
            }
            runs.push((64 * b) as f64 / t.elapsed().as_secs_f64());
        }
        Ok(median(runs))
    };
    let d1 = decode(1)?;
    let d64 = decode(64)?;
    // A decode step reads every weight byte once: the bound on steps/s.
    let bound_steps = bw_gbs * 1e9 / spec.weight_bytes as f64;
    println!("| measurement | tokens/s | bound from {bw_gbs:.0} GB/s | of bound |");
    println!("|---|---:|---:|---:|");
    println!("| prefill, 512-token prompt | {:.0} | | |", median(pp));
    println!(
        "| decode, batch 1 | {d1:.1} | {bound_steps:.0} | {:.0}% |",
        100.0 * d1 / bound_steps
    );
    println!(
        "| decode, batch 64 | {d64:.1} | {:.0} | {:.0}% |",
        64.0 * bound_steps,
        100.0 * d64 / (64.0 * bound_steps)
    );
    Ok(())
}
