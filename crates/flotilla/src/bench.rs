//! `flotilla bench-model`: prompt processing, single-stream decode and
//! batched decode of the CPU backend, beside llama.cpp's `llama-bench` and
//! `llama-batched-bench` on the same file and thread count, in one run.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use flotilla_model::{CpuExecutor, Executor, OutputKind, SamplingParams, SeqInput, StepOutputs};

use crate::ModelArgs;

/// Arguments of `bench-model`.
#[derive(clap::Args)]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt length of the prompt-processing test (llama-bench's -p).
    #[arg(long, default_value_t = 512)]
    pp: usize,
    /// Context already in the cache when the prompt-processing test
    /// starts, prefilled untimed (llama-bench's -d): a prompt chunk at
    /// depth, as a chat's next turn after its history (a prefix-cache or
    /// offload-tier hit) is computed, attention over the depth included.
    #[arg(long, default_value_t = 0)]
    pp_depth: usize,
    /// Tokens of the single-stream decode test (llama-bench's -n).
    #[arg(long, default_value_t = 128)]
    tg: usize,
    /// Context already in the cache when the single-stream decode test
    /// starts, prefilled untimed (llama-bench's -d): decode speed at depth,
    /// where attention reads the KV cache as much as the weights.
    #[arg(long, default_value_t = 0)]
    tg_depth: usize,
    /// Parallel sequences of the batched decode test (llama-batched-bench's -npl).
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    batches: Vec<usize>,
    /// Prompt tokens per sequence before batched decode (-npp).
    #[arg(long, default_value_t = 128)]
    batch_prompt: usize,
    /// Decode tokens per sequence in batched decode (-ntg).
    #[arg(long, default_value_t = 128)]
    batch_gen: usize,
    /// Repetitions; the best and the mean are reported.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Folder with llama.cpp's llama-bench and llama-batched-bench
    /// (default: ~/.cache/flotilla-peers/llama.cpp/build/bin if present).
    #[arg(long)]
    llama_cpp: Option<PathBuf>,
    /// Skip the llama.cpp runs.
    #[arg(long)]
    no_peer: bool,
    /// Instead of the tests above, time the steps the simulator's cost
    /// model is fitted to (prompt chunks and decode batches at several
    /// depths), fit this machine's figures at these threads, and write
    /// them to this file: a `[gpu]` for `flotilla simulate` and `flotilla
    /// plan --gpu FILE`.
    #[arg(long)]
    fit: Option<PathBuf>,
}

struct Row {
    name: String,
    ours: f64,
    peer: Option<f64>,
    target: Option<f64>,
}

/// Deterministic pseudo-random token ids (llama-bench also uses random tokens).
fn tokens(n: usize, seed: u64, vocab: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % vocab as u64) as u32
        })
        .collect()
}

pub fn run(a: &BenchArgs) -> Result<()> {
    if a.model.device() != flotilla_cuda::Device::Cpu {
        bail!(
            "bench-model measures the CPU backend; the CUDA benchmark is \
             tests/cuda/gpu-check.sh (--device applies to serve and node)"
        );
    }
    if a.pp == 0
        || a.tg == 0
        || a.reps == 0
        || a.batches.contains(&0)
        || a.batch_gen == 0
        || a.batch_prompt == 0
    {
        bail!("--pp, --tg, --reps, --batches, --batch-prompt and --batch-gen must be positive");
    }
    let path = a.model.path()?;
    let g = flotilla_gguf::GgufFile::open(&path)?;
    if let Some(out) = &a.fit {
        return fit(a, &g, out);
    }
    // Every test's sequence fits the model's context, checked before the
    // KV cache is sized from them.
    let ctx = flotilla_model::arch::ModelConfig::from_gguf(&g)?.ctx_len;
    for (flags, before, len) in [
        ("--pp-depth and --pp", a.pp_depth, a.pp),
        ("--tg-depth and --tg", a.tg_depth, a.tg),
        (
            "--batch-prompt and --batch-gen",
            a.batch_prompt,
            a.batch_gen,
        ),
    ] {
        if before.saturating_add(len) > ctx {
            bail!("{flags}: {before} + {len} tokens, beyond the model's context of {ctx} tokens");
        }
    }
    let max_b = a.batches.iter().copied().max().unwrap_or(1);
    let bs = a.model.block_size;
    let per_seq = (a.batch_prompt + a.batch_gen).div_ceil(bs);
    let blocks = (max_b * per_seq)
        .max((a.pp_depth + a.pp).div_ceil(bs))
        .max((a.tg_depth + a.tg).div_ceil(bs));
    let budget = a.pp.max(max_b).max(a.batch_prompt).min(4096);
    let cfg = a.model.cpu_config(blocks, budget)?;
    let t0 = Instant::now();
    let mut e =
        crate::alloc::loading(|| CpuExecutor::from_gguf(&g, &cfg)).context("loading the model")?;
    let threads = e.threads();
    let vocab = e.model_spec().vocab;
    let (kernel, macs_per_token) = (e.kernel(), e.matmul_macs_per_token());
    if let Some(note) = e.load_note() {
        eprintln!("{note}");
    }
    eprintln!(
        "model {} ({:.1} MB of weights), {} threads, kernel {:?}, KV {:?} x {} blocks of {} ({:.0} MB), loaded in {:.2}s",
        path.display(),
        e.model_spec().weight_bytes as f64 / 1e6,
        threads,
        e.kernel(),
        e.kv_spec().dtype,
        blocks,
        bs,
        (e.kv_spec().bytes_per_block * blocks) as f64 / 1e6,
        t0.elapsed().as_secs_f64()
    );
    eprintln!("architecture {}", e.config().describe());
    let mut out = StepOutputs::default();
    let table: Vec<u32> = (0..blocks as u32).collect();
    let greedy = OutputKind::Sample(SamplingParams::greedy());

    // Context prefilled untimed: `n` tokens (seed `seed`) from position 0.
    let fill = |e: &mut CpuExecutor, out: &mut StepOutputs, n: usize, seed: u64| {
        let depth = tokens(n, seed, vocab);
        for (i, c) in depth.chunks(budget).enumerate() {
            e.step(
                &[SeqInput {
                    tokens: c,
                    start_pos: i * budget,
                    block_table: &table,
                    output: OutputKind::None,
                    bias: &[],
                    draft_bias: &[],
                    allow: None,
                }],
                out,
            )?;
        }
        anyhow::Ok(())
    };
    // pp: one step of `pp` prompt tokens after `pp_depth` of context,
    // logits of the last (each repetition rewrites the same positions).
    fill(&mut e, &mut out, a.pp_depth, 3)?;
    let prompt = tokens(a.pp, 1, vocab);
    let mut pp = Vec::new();
    for rep in 0..=a.reps {
        let t = Instant::now();
        e.step(
            &[SeqInput {
                tokens: &prompt,
                start_pos: a.pp_depth,
                block_table: &table,
                output: OutputKind::Logits,
                bias: &[],
                draft_bias: &[],
                allow: None,
            }],
            &mut out,
        )?;
        if rep > 0 {
            pp.push(a.pp as f64 / t.elapsed().as_secs_f64());
        }
    }
    // tg: `tg` single-token steps after `tg_depth` tokens of context, greedy.
    fill(&mut e, &mut out, a.tg_depth, 7)?;
    let mut tg = Vec::new();
    for rep in 0..=a.reps.min(2) {
        let mut tok = 1u32;
        let t = Instant::now();
        for pos in a.tg_depth..a.tg_depth + a.tg {
            e.step(
                &[SeqInput {
                    tokens: &[tok],
                    start_pos: pos,
                    block_table: &table,
                    output: greedy,
                    bias: &[],
                    draft_bias: &[],
                    allow: None,
                }],
                &mut out,
            )?;
            tok = out.token_of(0).unwrap_or(1);
        }
        if rep > 0 {
            tg.push(a.tg as f64 / t.elapsed().as_secs_f64());
        }
    }
    // Batched decode: B sequences, each prefilled with `batch_prompt` tokens
    // (untimed), then `batch_gen` steps of B decode tokens.
    let mut batched = Vec::new();
    for &b in &a.batches {
        let tables: Vec<&[u32]> = (0..b)
            .map(|i| &table[i * per_seq..(i + 1) * per_seq])
            .collect();
        let prompts: Vec<Vec<u32>> = (0..b)
            .map(|i| tokens(a.batch_prompt, 100 + i as u64, vocab))
            .collect();
        for (i, p) in prompts.iter().enumerate() {
            e.step(
                &[SeqInput {
                    tokens: p,
                    start_pos: 0,
                    block_table: tables[i],
                    output: greedy,
                    bias: &[],
                    draft_bias: &[],
                    allow: None,
                }],
                &mut out,
            )?;
        }
        let mut last: Vec<u32> = vec![1; b];
        let t = Instant::now();
        for g in 0..a.batch_gen {
            let batch: Vec<SeqInput<'_>> = (0..b)
                .map(|i| SeqInput {
                    tokens: std::slice::from_ref(&last[i]),
                    start_pos: a.batch_prompt + g,
                    block_table: tables[i],
                    output: greedy,
                    bias: &[],
                    draft_bias: &[],
                    allow: None,
                })
                .collect();
            e.step(&batch, &mut out)?;
            drop(batch);
            for (i, l) in last.iter_mut().enumerate() {
                *l = out.token_of(i).unwrap_or(1);
            }
        }
        batched.push((b, (b * a.batch_gen) as f64 / t.elapsed().as_secs_f64()));
    }
    let rss_mb = peak_rss_mb();
    let weights = e.model_spec().weight_bytes;
    let kv_bytes = e.kv_spec().bytes_per_block * blocks;
    drop(e);

    let peer = if a.no_peer {
        None
    } else {
        peer_dir(a.llama_cpp.as_deref())
    };
    let (peer_pp, peer_tg, peer_batched) = match &peer {
        Some(dir) => {
            eprintln!(
                "running llama.cpp from {} with {threads} threads ...",
                dir.display()
            );
            let kv = peer_kv_args(cfg.kv_dtype);
            eprintln!("llama.cpp KV cache flags: {}", kv.join(" "));
            let (p, t) = llama_bench(
                dir,
                &path,
                threads,
                (a.pp, a.pp_depth),
                (a.tg, a.tg_depth),
                a.reps,
                &kv,
            )
            .unwrap_or_else(|e| {
                eprintln!("llama-bench failed: {e:#}");
                (None, None)
            });
            let b = llama_batched_bench(
                dir,
                &path,
                threads,
                a.batch_prompt,
                a.batch_gen,
                &a.batches,
                &kv,
            )
            .unwrap_or_else(|e| {
                eprintln!("llama-batched-bench failed: {e:#}");
                Vec::new()
            });
            (p, t, b)
        }
        None => (None, None, Vec::new()),
    };
    let best = |v: &[f64]| v.iter().cloned().fold(0.0, f64::max);
    let mut rows = vec![
        Row {
            name: if a.pp_depth > 0 {
                format!("pp{} @ depth {}", a.pp, a.pp_depth)
            } else {
                format!("pp{}", a.pp)
            },
            ours: best(&pp),
            peer: peer_pp,
            target: Some(2.5),
        },
        Row {
            name: if a.tg_depth > 0 {
                format!("tg{} @ depth {}", a.tg, a.tg_depth)
            } else {
                format!("tg{}", a.tg)
            },
            ours: best(&tg),
            peer: peer_tg,
            target: Some(1.3),
        },
    ];
    for (b, v) in &batched {
        let p = peer_batched.iter().find(|(pb, _)| pb == b).map(|(_, v)| *v);
        let target = if *b == 32 { Some(4.0) } else { None };
        rows.push(Row {
            name: format!(
                "decode batch {b} (npp {}, ntg {})",
                a.batch_prompt, a.batch_gen
            ),
            ours: *v,
            peer: p,
            target,
        });
    }
    println!();
    println!("| test | flotilla tok/s | llama.cpp tok/s | ratio | target |");
    println!("|---|---:|---:|---:|---:|");
    for r in &rows {
        let peer = r.peer.map_or("-".to_string(), |p| format!("{p:.1}"));
        let ratio = r
            .peer
            .map_or("-".to_string(), |p| format!("{:.2}x", r.ours / p));
        let target = r.target.map_or("-".to_string(), |t| format!(">= {t}x"));
        println!(
            "| {} | {:.1} | {} | {} | {} |",
            r.name, r.ours, peer, ratio, target
        );
    }
    // A prompt is compute-bound: its multiply-adds beside what this CPU's
    // int8 instruction sustains on the same threads.
    let pp_gops = 2.0 * macs_per_token as f64 * best(&pp) / 1e9;
    match flotilla_model::kernels::peak::int8_peak_gops(kernel, threads) {
        Some(peak) => println!(
            "pp{}: {pp_gops:.0} GOP/s of int8 multiply-adds in the layers' matrices, {:.0}% of this \
             CPU's int8 peak ({peak:.0} GOP/s: kernel {kernel:?}'s instruction alone on {threads} threads)",
            a.pp,
            100.0 * pp_gops / peak
        ),
        None => println!(
            "pp{}: {pp_gops:.0} GOP/s of multiply-adds in the layers' matrices",
            a.pp
        ),
    }
    let file_mb = std::fs::metadata(&path)
        .map(|m| m.len() as f64 / 1e6)
        .unwrap_or(0.0);
    println!();
    println!(
        "threads {threads}; peak RSS {rss_mb:.0} MB (model file {file_mb:.0} MB, KV cache {:.0} MB)",
        kv_bytes as f64 / 1e6
    );
    // A single-stream decode reads every weight once per token: its rate of
    // weight reads beside what this machine can read, from a buffer the
    // weights' size (which may sit in the last-level cache) and from one
    // far larger (memory).
    let tg_gbs = weights as f64 * best(&tg) / 1e9;
    let cached = read_bandwidth_gbs(weights, threads);
    let memory = read_bandwidth_gbs(weights.max(1 << 30), threads);
    println!(
        "tg{}: {:.1} GB/s of weight reads ({:.1} MB per token); this machine reads {cached:.1} GB/s from a buffer of the weights' size ({:.0}%) and {memory:.1} GB/s from {:.0} MB ({:.0}%), {threads} threads{}",
        a.tg,
        tg_gbs,
        weights as f64 / 1e6,
        100.0 * tg_gbs / cached,
        weights.max(1 << 30) as f64 / 1e6,
        100.0 * tg_gbs / memory,
        last_level_cache()
            .map(|c| format!("; last-level cache {c}"))
            .unwrap_or_default()
    );
    Ok(())
}

/// `bench-model --fit`: times each of the cost model's fit steps (median
/// of `--reps`, at least 5), fits the CPU backend's figures, prints each
/// step measured beside the fit, and writes the figures as TOML.
fn fit(a: &BenchArgs, g: &flotilla_gguf::GgufFile, out: &Path) -> Result<()> {
    use flotilla_sim::cost::{self, GpuParams, ModelShape};
    let config = flotilla_model::arch::ModelConfig::from_gguf(g)?;
    let steps = cost::fit_steps();
    // Each sequence slot's blocks: as many as its longest use.
    let slots = steps.iter().map(Vec::len).max().unwrap_or(1);
    let bs = a.model.block_size;
    let need: Vec<usize> = (0..slots)
        .map(|i| {
            steps
                .iter()
                .filter_map(|b| b.get(i).map(|s| (s.start_pos + s.tokens).div_ceil(bs)))
                .max()
                .unwrap_or(1)
        })
        .collect();
    if need.iter().max().unwrap_or(&0) * bs > config.ctx_len {
        bail!(
            "--fit needs contexts of {} tokens; the model's is {}",
            need.iter().max().unwrap_or(&0) * bs,
            config.ctx_len
        );
    }
    let blocks: usize = need.iter().sum();
    let budget = steps
        .iter()
        .map(|b| b.iter().map(|s| s.tokens).sum::<usize>())
        .max()
        .unwrap_or(1);
    let cfg = a.model.cpu_config(blocks, budget)?;
    let mut e =
        crate::alloc::loading(|| CpuExecutor::from_gguf(g, &cfg)).context("loading the model")?;
    let threads = e.threads();
    let vocab = e.model_spec().vocab;
    let weights = e.model_spec().weight_bytes;
    // Linear FLOPs a token: the layers' matrices and the output head (which
    // runs for each sampled token, and once for a prompt chunk: the fitted
    // prefill rate takes that in).
    let params = (e.matmul_macs_per_token() + config.vocab * config.n_embd) as f64;
    let mut first = 0u32;
    let tables: Vec<Vec<u32>> = need
        .iter()
        .map(|&n| {
            let t: Vec<u32> = (first..first + n as u32).collect();
            first += n as u32;
            t
        })
        .collect();
    let mut o = StepOutputs::default();
    // Every slot's context written once, untimed: the timed steps read it.
    for (i, t) in tables.iter().enumerate() {
        let ctx = tokens(need[i] * bs, 50 + i as u64, vocab);
        for (k, c) in ctx.chunks(budget).enumerate() {
            e.step(
                &[SeqInput {
                    tokens: c,
                    start_pos: k * budget,
                    block_table: t,
                    output: OutputKind::None,
                    bias: &[],
                    draft_bias: &[],
                    allow: None,
                }],
                &mut o,
            )?;
        }
    }
    let greedy = OutputKind::Sample(SamplingParams::greedy());
    let reps = a.reps.max(5);
    let mut measured = Vec::new();
    for batch in &steps {
        let toks: Vec<Vec<u32>> = batch
            .iter()
            .enumerate()
            .map(|(i, s)| tokens(s.tokens, 900 + i as u64, vocab))
            .collect();
        let mut times = Vec::new();
        for rep in 0..=reps {
            let inputs: Vec<SeqInput<'_>> = batch
                .iter()
                .enumerate()
                .map(|(i, s)| SeqInput {
                    tokens: &toks[i],
                    start_pos: s.start_pos,
                    block_table: &tables[i],
                    // A prompt's last chunk gives logits; a decode token is sampled.
                    output: if s.tokens > 1 {
                        OutputKind::Logits
                    } else {
                        greedy
                    },
                    bias: &[],
                    draft_bias: &[],
                    allow: None,
                })
                .collect();
            let t = Instant::now();
            e.step(&inputs, &mut o)?;
            if rep > 0 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        times.sort_by(f64::total_cmp);
        measured.push((batch.clone(), times[times.len() / 2]));
    }
    drop(e);
    let shape = ModelShape {
        name: path_name(&a.model.path()?),
        params,
        weight_bytes_per_param: weights as f64 / params,
        n_layer: config.n_layer,
        q_width: config.n_head * config.head_dim,
        n_head_kv: config.n_head_kv,
        head_dim: config.head_dim,
        kv_dtype: cfg.kv_dtype,
        vocab: config.vocab,
        ctx_len: config.ctx_len,
        window: config
            .layers
            .iter()
            .filter_map(|l| l.window)
            .max()
            .unwrap_or(0),
        window_layers: config.layers.iter().filter(|l| l.window.is_some()).count(),
    };
    let mem_bw = read_bandwidth_gbs(weights, threads) * 1e9;
    // The KV cache `serve` makes by default: 10% of the memory it sees.
    let kv = crate::memory::MemoryBudget::detect(weights as u64)
        .map(|m| m.bytes as f64 * 0.1)
        .map_err(anyhow::Error::msg)?;
    let name = format!("cpu-fit-{threads}t");
    let gpu: GpuParams = cost::fit_unoverlapped(
        &name,
        &shape,
        &measured,
        mem_bw,
        (weights as f64 + kv) / 0.9,
    )
    .map_err(anyhow::Error::msg)?;
    println!("| step | measured ms | fitted ms | fitted/measured |");
    println!("|---|---:|---:|---:|");
    let mut worst = 0f64;
    for (b, t) in &measured {
        let f = cost::step_time(&gpu, &shape, b).as_secs_f64();
        worst = worst.max((f / t - 1.0).abs());
        let what = if b[0].tokens > 1 {
            format!("prompt chunk {} @ depth {}", b[0].tokens, b[0].start_pos)
        } else {
            format!("decode batch {} @ context {}", b.len(), b[0].start_pos)
        };
        println!(
            "| {what} | {:.2} | {:.2} | {:.2} |",
            t * 1e3,
            f * 1e3,
            f / t
        );
    }
    println!(
        "fit: overhead {:.3} ms, linear {:.3e} FLOP/s prefill and {:.3e} decode, attention \
         {:.3e} prefill and {:.3e} decode, memory {:.3e} B/s (measured); worst step {:.1}% off",
        gpu.overhead_s * 1e3,
        gpu.prefill_flops,
        gpu.decode_flops,
        gpu.attn_prefill_flops.unwrap_or(0.0),
        gpu.attn_decode_flops.unwrap_or(0.0),
        gpu.mem_bw,
        worst * 100.0
    );
    let cpu_model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let text = format!(
        "# Written by `flotilla bench-model --fit` on {cpu_model}, {threads} threads, model {}\n\
         # ({} layers, {:.3e} parameters in the matrices, {:.1} MB of weights, KV {}).\n\
         # [gpu]: this machine's figures for [model], the shape they were fitted with\n\
         # (use the two together). mem_bytes: the weights and the KV cache `serve`\n\
         # sizes by default here, + 10%. Use both tables in a scenario, or\n\
         # `flotilla plan --gpu THIS_FILE` (which takes its [model] too).\n{}",
        shape.name,
        shape.n_layer,
        shape.params,
        weights as f64 / 1e6,
        shape.kv_dtype,
        toml::to_string(&Fitted {
            gpu,
            model: shape.clone()
        })
        .context("writing the fit as TOML")?
    );
    std::fs::write(out, text).with_context(|| format!("writing {}", out.display()))?;
    println!("wrote {}", out.display());
    Ok(())
}

/// What `--fit` writes: the figures and the shape they go with.
#[derive(serde::Serialize)]
struct Fitted {
    gpu: flotilla_sim::cost::GpuParams,
    model: flotilla_sim::cost::ModelShape,
}

fn path_name(p: &Path) -> String {
    p.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into())
}

/// What `threads` threads read from a buffer of `bytes`, GB/s: the best
/// of nine passes after one that pages it in, each thread summing its own
/// part (the sum is kept, so the reads cannot be dropped).
fn read_bandwidth_gbs(bytes: usize, threads: usize) -> f64 {
    let words = (bytes / 8).max(threads * 64);
    let buf: Vec<u64> = (0..words as u64).collect();
    let part = words.div_ceil(threads.max(1));
    let mut best = 0f64;
    let mut keep = 0u64;
    for pass in 0..10 {
        let t = Instant::now();
        let sums: Vec<u64> = std::thread::scope(|s| {
            let hs: Vec<_> = buf
                .chunks(part)
                .map(|c| {
                    s.spawn(move || {
                        // 32 running sums: the adds overlap, the reads lead.
                        let mut acc = [0u64; 32];
                        for w in c.chunks_exact(32) {
                            for (a, v) in acc.iter_mut().zip(w) {
                                *a = a.wrapping_add(*v);
                            }
                        }
                        acc.iter().fold(0u64, |a, b| a.wrapping_add(*b))
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or(0)).collect()
        });
        let secs = t.elapsed().as_secs_f64();
        keep = keep.wrapping_add(sums.iter().fold(0, |a, b| a.wrapping_add(*b)));
        if pass > 0 {
            best = best.max((words * 8) as f64 / secs / 1e9);
        }
    }
    std::hint::black_box(keep);
    best
}

/// The last-level cache's size as sysfs gives it (Linux), e.g. `32768K`.
fn last_level_cache() -> Option<String> {
    (0..8)
        .rev()
        .find_map(|i| {
            std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu0/cache/index{i}/size"))
                .ok()
        })
        .map(|s| s.trim().to_string())
}

fn peak_rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|v| v.parse::<f64>().ok())
            })
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

fn peer_dir(given: Option<&Path>) -> Option<PathBuf> {
    let dir = match given {
        Some(d) => d.to_path_buf(),
        None => PathBuf::from(std::env::var_os("HOME")?)
            .join(".cache/flotilla-peers/llama.cpp/build/bin"),
    };
    if dir.join("llama-bench").is_file() {
        Some(dir)
    } else {
        eprintln!(
            "llama.cpp not found in {}: build it with ../shared/tools/build-llama-cpp or pass --llama-cpp DIR",
            dir.display()
        );
        None
    }
}

fn json_lines(out: &[u8]) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(out)
        .lines()
        .filter_map(|l| {
            serde_json::from_str::<serde_json::Value>(l.trim().trim_end_matches(',')).ok()
        })
        .collect()
}

/// llama.cpp's flags for the KV cache type that Flotilla runs: its int8
/// KV is q8_0 for K and V, which llama.cpp runs only with flash attention.
fn peer_kv_args(dtype: flotilla_model::KvDtype) -> Vec<&'static str> {
    use flotilla_model::KvDtype;
    match dtype {
        KvDtype::F16 => vec!["-ctk", "f16", "-ctv", "f16"],
        KvDtype::F32 => vec!["-ctk", "f32", "-ctv", "f32"],
        KvDtype::Int8 => vec!["-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"],
    }
}

/// llama-bench's pp and tg (at depth `tg.1`, a run of its own then).
fn llama_bench(
    dir: &Path,
    model: &Path,
    threads: usize,
    (pp, pp_depth): (usize, usize),
    (tg, depth): (usize, usize),
    reps: usize,
    kv: &[&str],
) -> Result<(Option<f64>, Option<f64>)> {
    let run = |args: &[String]| -> Result<Vec<serde_json::Value>> {
        let out = Command::new(dir.join("llama-bench"))
            .args([
                "-m",
                &model.display().to_string(),
                "-t",
                &threads.to_string(),
                "-r",
                &reps.to_string(),
                "-o",
                "jsonl",
            ])
            .args(kv)
            .args(args)
            .output()
            .context("running llama-bench")?;
        if !out.status.success() {
            bail!(
                "llama-bench exited with {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(json_lines(&out.stdout))
    };
    let s = |v: usize| v.to_string();
    // One run for both tests when neither is at depth; else one each, as
    // llama-bench's -d applies to every test of a run.
    let together = depth == 0 && pp_depth == 0;
    let mut first = vec![
        "-p".into(),
        s(pp),
        "-n".into(),
        s(if together { tg } else { 0 }),
    ];
    if pp_depth > 0 {
        first.extend(["-d".into(), s(pp_depth)]);
    }
    let mut lines = run(&first)?;
    if !together {
        lines.extend(run(&[
            "-p".into(),
            s(0),
            "-n".into(),
            s(tg),
            "-d".into(),
            s(depth),
        ])?);
    }
    let mut p = None;
    let mut t = None;
    for v in lines {
        let ts = v["avg_ts"].as_f64();
        if v["n_prompt"].as_u64() == Some(pp as u64) && v["n_gen"].as_u64() == Some(0) {
            p = ts;
        }
        if v["n_gen"].as_u64() == Some(tg as u64) && v["n_prompt"].as_u64() == Some(0) {
            t = ts;
        }
    }
    Ok((p, t))
}

fn llama_batched_bench(
    dir: &Path,
    model: &Path,
    threads: usize,
    npp: usize,
    ntg: usize,
    npl: &[usize],
    kv: &[&str],
) -> Result<Vec<(usize, f64)>> {
    let max_pl = npl.iter().copied().max().unwrap_or(1);
    let ctx = max_pl * (npp + ntg) + 16;
    let npl_s: Vec<String> = npl.iter().map(|v| v.to_string()).collect();
    let out = Command::new(dir.join("llama-batched-bench"))
        .args([
            "-m",
            &model.display().to_string(),
            "-t",
            &threads.to_string(),
            "-c",
            &ctx.to_string(),
        ])
        .args([
            "-b",
            "2048",
            "-ub",
            "512",
            "-npp",
            &npp.to_string(),
            "-ntg",
            &ntg.to_string(),
        ])
        .args(["-npl", &npl_s.join(","), "--output-format", "jsonl"])
        .args(kv)
        .output()
        .context("running llama-batched-bench")?;
    if !out.status.success() {
        bail!(
            "llama-batched-bench exited with {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(json_lines(&out.stdout)
        .into_iter()
        .filter_map(|v| Some((v["pl"].as_u64()? as usize, v["speed_tg"].as_f64()?)))
        .collect())
}

/// Arguments of `bench-kv-quality`.
#[derive(clap::Args)]
pub struct KvQualityArgs {
    /// The model and the KV cache dtype to measure (`--kv-cache-dtype`,
    /// default int8); the reference is the same model with an f16 cache.
    #[command(flatten)]
    model: ModelArgs,
    /// The text to teacher-force (default: tests/fixtures/kv_quality.txt).
    #[arg(long)]
    file: Option<PathBuf>,
    /// Tokens per chunk: each chunk starts from an empty cache, as
    /// llama-perplexity's -c (its statistics cover each chunk's second half).
    #[arg(long, default_value_t = 512)]
    chunk: usize,
    /// Folder with llama.cpp's llama-perplexity (default:
    /// ~/.cache/flotilla-peers/llama.cpp/build/bin if present).
    #[arg(long)]
    llama_cpp: Option<PathBuf>,
    /// Skip the llama.cpp runs.
    #[arg(long)]
    no_peer: bool,
    /// Instead of the tests above, time the steps the simulator's cost
    /// model is fitted to (prompt chunks and decode batches at several
    /// depths), fit this machine's figures at these threads, and write
    /// them to this file: a `[gpu]` for `flotilla simulate` and `flotilla
    /// plan --gpu FILE`.
    #[arg(long)]
    fit: Option<PathBuf>,
}

/// `flotilla bench-kv-quality`: how far the next-token distributions with
/// a cheaper KV cache drift from those with an f16 cache, teacher-forced
/// over a text, beside llama.cpp's `llama-perplexity --kl-divergence` with
/// the matching cache types on the same file, chunk size and threads.
pub fn run_kv_quality(a: &KvQualityArgs) -> Result<()> {
    use flotilla_model::KvDtype;
    use flotilla_model::quality::{divergence, teacher_forced_logprobs};
    if a.model.device() != flotilla_cuda::Device::Cpu {
        bail!("bench-kv-quality measures the CPU backend");
    }
    if a.chunk < 2 {
        bail!("--chunk must be at least 2");
    }
    let path = a.model.path()?;
    let file = a.file.clone().unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/kv_quality.txt")
    });
    let text = std::fs::read_to_string(&file)
        .with_context(|| format!("--file {}: cannot read it", file.display()))?;
    let g = flotilla_gguf::GgufFile::open(&path)?;
    let side = flotilla_text::TextSide::from_gguf(&g).context("loading the tokenizer")?;
    let ids = side.tokenizer.encode(&text, false)?;
    let chunks: Vec<&[u32]> = ids.chunks_exact(a.chunk).collect();
    if chunks.is_empty() {
        bail!(
            "--file {} has {} tokens, fewer than one --chunk of {}",
            file.display(),
            ids.len(),
            a.chunk
        );
    }
    // The flag names the dtype measured (int8 unless given); f16 is the reference.
    let base = a
        .model
        .cpu_config(a.chunk.div_ceil(a.model.block_size), a.chunk.min(512))?;
    let dtype = match a.model.kv_cache_dtype {
        Some(_) => base.kv_dtype,
        None => KvDtype::Int8,
    };
    let run = |kv_dtype: KvDtype| -> Result<(Vec<Vec<f32>>, usize)> {
        let cfg = flotilla_model::CpuConfig {
            kv_dtype,
            ..base.clone()
        };
        let mut e = CpuExecutor::from_gguf(&g, &cfg).context("loading the model")?;
        let mut rows = Vec::new();
        for c in &chunks {
            rows.extend(teacher_forced_logprobs(&mut e, c)?);
        }
        Ok((rows, e.threads()))
    };
    let t0 = Instant::now();
    let (reference, threads) = run(KvDtype::F16)?;
    let (measured, _) = run(dtype)?;
    eprintln!(
        "{} chunks of {} tokens from {}, f16 and {dtype} KV, {threads} threads, {:.1}s",
        chunks.len(),
        a.chunk,
        file.display(),
        t0.elapsed().as_secs_f64()
    );
    // Every position, and (as llama-perplexity scores) each chunk's second half.
    let all = divergence(&reference, &measured, |_| true);
    let half = divergence(&reference, &measured, |i| i % a.chunk >= a.chunk / 2);
    let peer = if a.no_peer {
        None
    } else {
        peer_dir(a.llama_cpp.as_deref()).and_then(|dir| {
            llama_kld(&dir, &path, &file, a.chunk, threads, dtype).map_or_else(
                |e| {
                    eprintln!("llama-perplexity failed: {e:#}");
                    None
                },
                Some,
            )
        })
    };
    println!();
    println!(
        "| {dtype} KV vs f16 KV | positions | mean KL | p99 KL | max KL | top-1 agreement | largest top-1 gap flipped |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for (name, d) in [
        ("flotilla, every position", &all),
        ("flotilla, second halves", &half),
    ] {
        println!(
            "| {name} | {} | {:.6} | {:.6} | {:.6} | {:.2}% | {:.3} |",
            d.positions,
            d.mean_kl,
            d.p99_kl,
            d.max_kl,
            100.0 * d.top1_agreement,
            d.max_flip_gap
        );
    }
    match peer {
        Some((kl, same)) => println!(
            "| llama.cpp ({}), second halves | - | {kl:.6} | - | - | {same:.2}% | - |",
            peer_kv_args(dtype).join(" ")
        ),
        None => println!("| llama.cpp | (not run) | | | | | |"),
    }
    Ok(())
}

/// Arguments of `bench-logits`.
#[derive(clap::Args)]
pub struct LogitsArgs {
    /// The model, and Flotilla's KV cache dtype (`--kv-cache-dtype`,
    /// default f16; llama.cpp's reference runs with an f16 cache).
    #[command(flatten)]
    model: ModelArgs,
    /// The text (default: tests/fixtures/kv_quality.txt).
    #[arg(long)]
    file: Option<PathBuf>,
    /// Tokens per chunk (llama-perplexity's -c); each chunk's second half
    /// is compared.
    #[arg(long, default_value_t = 512)]
    chunk: usize,
    /// Chunks to run (llama-perplexity's --chunks; default: all the text holds).
    #[arg(long)]
    chunks: Option<usize>,
    /// Folder with llama.cpp's llama-perplexity (default:
    /// ~/.cache/flotilla-peers/llama.cpp/build/bin).
    #[arg(long)]
    llama_cpp: Option<PathBuf>,
}

/// `flotilla bench-logits`: Flotilla's next-token distributions against
/// llama.cpp's on the same tokens. llama-perplexity writes its own
/// log-probabilities (`--kl-divergence-base`: the tokens it ran and, per
/// chunk, its second half's rows); Flotilla runs those very tokens,
/// teacher-forced, and the two are compared position by position (KL of
/// Flotilla's from llama.cpp's, top-1 agreement), beside llama.cpp's own
/// q8_0-against-f16 KV figure from the same base, the size of a difference
/// its users already accept.
pub fn run_logits(a: &LogitsArgs) -> Result<()> {
    use flotilla_model::quality::{PeerLogprobs, divergence_from_peer, teacher_forced_logprobs};
    if a.model.device() != flotilla_cuda::Device::Cpu {
        bail!("bench-logits measures the CPU backend");
    }
    if a.chunk < 4 {
        bail!("--chunk must be at least 4");
    }
    let path = a.model.path()?;
    let file = a.file.clone().unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/kv_quality.txt")
    });
    if !file.is_file() {
        bail!("--file {}: no such file", file.display());
    }
    let Some(dir) = peer_dir(a.llama_cpp.as_deref()) else {
        bail!("bench-logits needs llama.cpp's llama-perplexity");
    };
    let cfg = a
        .model
        .cpu_config(a.chunk.div_ceil(a.model.block_size), a.chunk.min(512))?;
    let threads = cfg.threads;
    let base = std::env::temp_dir().join(format!("flotilla-logits-{}.bin", std::process::id()));
    let run = |extra: &[&str], kv: &[&str]| -> Result<String> {
        let mut c = Command::new(dir.join("llama-perplexity"));
        c.args(["-m", &path.display().to_string()])
            .args(["-f", &file.display().to_string()])
            .args(["-c", &a.chunk.to_string(), "-b", &a.chunk.to_string()])
            .args(["-t", &threads.to_string()])
            .args(["--kl-divergence-base", &base.display().to_string()])
            .args(kv)
            .args(extra);
        if let Some(n) = a.chunks {
            c.args(["--chunks", &n.to_string()]);
        }
        let out = c.output().context("running llama-perplexity")?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if !out.status.success() {
            bail!("llama-perplexity exited with {}: {text}", out.status);
        }
        Ok(text)
    };
    let t0 = Instant::now();
    let peer = run(&[], &peer_kv_args(flotilla_model::KvDtype::F16)).and_then(|_| {
        let bytes = std::fs::read(&base).context("reading llama-perplexity's base file")?;
        let own = run(
            &["--kl-divergence"],
            &peer_kv_args(flotilla_model::KvDtype::Int8),
        )?;
        Ok((bytes, own))
    });
    let _ = std::fs::remove_file(&base);
    let (bytes, own) = peer?;
    let peer = PeerLogprobs::parse(&bytes, a.chunk).map_err(anyhow::Error::msg)?;
    drop(bytes);
    let peer_secs = t0.elapsed().as_secs_f64();

    let g = flotilla_gguf::GgufFile::open(&path)?;
    let side = flotilla_text::TextSide::from_gguf(&g).context("loading the tokenizer")?;
    let mut e =
        crate::alloc::loading(|| CpuExecutor::from_gguf(&g, &cfg)).context("loading the model")?;
    if e.model_spec().vocab != peer.n_vocab {
        bail!(
            "llama.cpp's vocabulary has {} entries, Flotilla's {}",
            peer.n_vocab,
            e.model_spec().vocab
        );
    }
    let t1 = Instant::now();
    let first = a.chunk / 2;
    let (mut want, mut floors, mut got) = (Vec::new(), Vec::new(), Vec::new());
    for (c, toks) in peer.chunks.iter().enumerate() {
        let mut toks = toks.clone();
        // llama-perplexity puts BOS in each chunk's first place where the
        // model adds one (its file holds the text's own tokens).
        if side.tokenizer.add_bos()
            && let Some(b) = side.tokenizer.bos()
        {
            toks[0] = b;
        }
        let rows = teacher_forced_logprobs(&mut e, &toks)?;
        got.extend(rows.into_iter().skip(first).take(a.chunk - 1 - first));
        want.extend(peer.rows[c].iter().cloned());
        floors.extend(peer.floors[c].iter().copied());
    }
    let d = divergence_from_peer(&want, &floors, &got);
    eprintln!(
        "{} chunks of {} tokens from {}; llama.cpp {peer_secs:.1}s (two runs), flotilla {:.1}s,          {threads} threads, kernel {:?}, KV {}",
        peer.chunks.len(),
        a.chunk,
        file.display(),
        t1.elapsed().as_secs_f64(),
        e.kernel(),
        e.kv_spec().dtype
    );
    let num = |key: &str| -> Option<f64> {
        let line = own.lines().find(|l| l.trim_start().starts_with(key))?;
        line[line.find(':')? + 1..]
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    println!();
    println!(
        "| against llama.cpp (f16 KV), second halves | positions | mean KL | p99 KL | max KL | top-1 agreement | largest top-1 gap flipped |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    println!(
        "| flotilla ({} KV) | {} | {:.6} | {:.6} | {:.6} | {:.2}% | {:.3} |",
        e.kv_spec().dtype,
        d.positions,
        d.mean_kl,
        d.p99_kl,
        d.max_kl,
        100.0 * d.top1_agreement,
        d.max_flip_gap
    );
    match (num("Mean    KLD"), num("Same top p")) {
        (Some(kl), Some(same)) => println!(
            "| llama.cpp's own q8_0 KV (-fa on -ctk q8_0 -ctv q8_0) | {} | {kl:.6} | - | - | {same:.2}% | - |",
            d.positions
        ),
        _ => println!("| llama.cpp's own q8_0 KV | (its output had no Mean KLD) | | | | | |"),
    }
    Ok(())
}

/// llama-perplexity's mean KL divergence and top-1 agreement ("same top
/// p") of a `dtype` cache from its own f16 cache on `file`.
fn llama_kld(
    dir: &Path,
    model: &Path,
    file: &Path,
    chunk: usize,
    threads: usize,
    dtype: flotilla_model::KvDtype,
) -> Result<(f64, f64)> {
    let base = std::env::temp_dir().join(format!("flotilla-kld-{}.bin", std::process::id()));
    let run = |extra: &[&str], kv: &[&str]| -> Result<String> {
        let out = Command::new(dir.join("llama-perplexity"))
            .args(["-m", &model.display().to_string()])
            .args(["-f", &file.display().to_string()])
            .args(["-c", &chunk.to_string(), "-b", &chunk.to_string()])
            .args(["-t", &threads.to_string()])
            .args(["--kl-divergence-base", &base.display().to_string()])
            .args(kv)
            .args(extra)
            .output()
            .context("running llama-perplexity")?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if !out.status.success() {
            bail!("llama-perplexity exited with {}: {text}", out.status);
        }
        Ok(text)
    };
    // The base logits file goes away whichever run fails.
    let text = run(&[], &peer_kv_args(flotilla_model::KvDtype::F16))
        .and_then(|_| run(&["--kl-divergence"], &peer_kv_args(dtype)));
    let _ = std::fs::remove_file(&base);
    let text = text?;
    let num = |key: &str| -> Option<f64> {
        let line = text.lines().find(|l| l.trim_start().starts_with(key))?;
        line[line.find(':')? + 1..]
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    match (num("Mean    KLD"), num("Same top p")) {
        (Some(kl), Some(same)) => Ok((kl, same)),
        _ => bail!("no 'Mean KLD' / 'Same top p' in llama-perplexity's output:\n{text}"),
    }
}
