//! Every kernel this CPU has, held to the f32 reference on the real models
//! (SmolLM2 135M, Q4_1 and Q8_0 matrices; Gemma 3 270M, Q4_K, Q6_K, Q8_0,
//! sliding windows, GeGLU).
//!
//! The reference is `Kernel::Exact` with an f32 KV cache (weights
//! dequantised, f32 activations). Every other kernel quantises activations
//! to 8 bits per 32 values, as llama.cpp does, which moves log-
//! probabilities by up to ~0.7 (measured); a kernel error moves them by
//! more. Each SIMD kernel the CPU has runs with every KV dtype:
//!
//! - teacher-forced over real text (each position a decode over the
//!   text's KV, as a served sequence sees it) and as prompt chunks of
//!   uneven lengths (the prefill path's attention, the AVX-512 lanes
//!   kernel included): per-position KL and the largest log-probability
//!   difference among the reference's top 20 tokens, bounded;
//! - free-running greedy continuations of raw text and of chat prompts
//!   (the template's special tokens first): they may part from the
//!   reference's only at a near-tie (its top token at most 1 nat ahead of
//!   the kernel's choice).
//!
//! A kernel the CPU lacks is named and skipped, so a machine whose CPU
//! differs from the last one's checks its own paths;
//! `FLOTILLA_REQUIRE_KERNELS=avx2,avx512,amx` makes a missing one a failure.

use std::path::PathBuf;

use flotilla_model::kernels::Kernel;
use flotilla_model::quality::{divergence, log_softmax, teacher_forced_logprobs};
use flotilla_model::{CpuConfig, CpuExecutor, KvDtype};

mod common;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// Tokens teacher-forced: enough context for several KV blocks (and the
/// lanes kernel's shared blocks), few enough for the exact path's speed.
const POSITIONS: usize = 144;

fn exec(path: &std::path::Path, kernel: Kernel, kv_dtype: KvDtype) -> CpuExecutor {
    exec_with(path, kernel, false, kv_dtype)
}

fn exec_with(
    path: &std::path::Path,
    kernel: Kernel,
    compact_k_quants: bool,
    kv_dtype: KvDtype,
) -> CpuExecutor {
    let cfg = CpuConfig {
        kernel,
        kv_dtype,
        compact_k_quants,
        threads: 2,
        num_blocks: 64,
        max_batch_tokens: 512,
        ..Default::default()
    };
    CpuExecutor::load(path, &cfg).expect("load the model")
}

fn tokens(path: &std::path::Path) -> Vec<u32> {
    let g = flotilla_gguf::GgufFile::open(path).unwrap();
    let side = flotilla_text::TextSide::from_gguf(&g).unwrap();
    let text = std::fs::read_to_string(fixtures().join("kv_quality.txt")).unwrap();
    let ids = side.tokenizer.encode(&text, false).unwrap();
    assert!(ids.len() >= POSITIONS, "the fixture text is too short");
    ids[..POSITIONS].to_vec()
}

/// A kernel by name, and whether its K-quants are at the file's size
/// (`CpuConfig::compact_k_quants`).
type KernelCase = (&'static str, Kernel, bool);

/// The SIMD kernels this CPU has, AVX2 and AVX-512 VNNI also with compact
/// K-quants (the scalar kernel, their plain-code twin, is held to them by
/// the kernels' own unit tests, and is too slow to run over real models
/// here).
fn kernels() -> Vec<KernelCase> {
    let required = std::env::var("FLOTILLA_REQUIRE_KERNELS").unwrap_or_default();
    let mut out = Vec::new();
    for (name, k) in [
        ("avx2", Kernel::Avx2),
        ("avx512", Kernel::Avx512),
        ("amx", Kernel::Amx),
    ] {
        if k.supported() {
            out.push((name, k, false));
            match k {
                Kernel::Avx2 => out.push(("avx2-compact", k, true)),
                Kernel::Avx512 => out.push(("avx512-compact", k, true)),
                _ => {}
            }
        } else {
            assert!(
                !required.split(',').any(|r| r.trim() == name),
                "FLOTILLA_REQUIRE_KERNELS names {name}, which this CPU lacks"
            );
            eprintln!("kernel {name}: not on this CPU, not checked here");
        }
    }
    out
}

/// The best kernel this CPU has, and the compact K-quant layout where the
/// CPU reads it (AMX reads the VNNI layouts, so AVX-512 VNNI's compact
/// case stands for both).
fn best_kernel() -> Vec<KernelCase> {
    let all = kernels();
    let best = all.last().map(|k| k.1);
    all.into_iter()
        .filter(|k| Some(k.1) == best || k.2)
        .collect()
}

/// Largest |a - b| over a row of log-probabilities.
fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// `(KL mean, KL max, top-20 |dlogp|)`: `KL max` bounds the worst
/// position's KL, `KL mean` the mean, `top-20 |dlogp|` the largest
/// log-probability difference among the reference's top 20 tokens (where
/// a departure changes what is sampled).
type Bounds = (f64, f64, f32);

/// Bounds every kernel x KV dtype against the exact path on one model.
fn check_model(name: &str, path: &std::path::Path, bounds: Bounds) {
    check_kernels(name, path, &kernels(), bounds, bounds);
}

/// `kernels` with every KV dtype against the f32 reference (`Kernel::Exact`,
/// f32 KV): f32 and f16 KV within `fine`, int8 KV within `int8`.
fn check_kernels(
    name: &str,
    path: &std::path::Path,
    kernels: &[KernelCase],
    fine: Bounds,
    int8: Bounds,
) {
    let ids = tokens(path);
    // Prompt chunks of uneven lengths: each chunk's last position's
    // log-probabilities through the prefill path.
    let ends: Vec<usize> = [37, 95, 110, 111, POSITIONS - 1].to_vec();
    let table: Vec<u32> = (0..POSITIONS.div_ceil(16) as u32).collect();
    let (want, want_chunks) = {
        let mut reference = exec(path, Kernel::Exact, KvDtype::F32);
        let want = teacher_forced_logprobs(&mut reference, &ids).unwrap();
        let chunks: Vec<Vec<f32>> = common::logits_at(&mut reference, &ids, &ends, &table)
            .iter()
            .map(|l| log_softmax(l))
            .collect();
        (want, chunks)
    };
    let mut failures = Vec::new();
    let top20: Vec<Vec<usize>> = want
        .iter()
        .chain(&want_chunks)
        .map(|row| {
            let mut idx: Vec<usize> = (0..row.len()).collect();
            idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
            idx.truncate(20);
            idx
        })
        .collect();
    for &(kname, kernel, compact) in kernels {
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Int8] {
            let mut e = exec_with(path, kernel, compact, dtype);
            let got = teacher_forced_logprobs(&mut e, &ids).unwrap();
            let got_chunks: Vec<Vec<f32>> = common::logits_at(&mut e, &ids, &ends, &table)
                .iter()
                .map(|l| log_softmax(l))
                .collect();
            let d = divergence(&want, &got, |_| true);
            let dc = divergence(&want_chunks, &got_chunks, |_| true);
            let top_diff = want
                .iter()
                .chain(&want_chunks)
                .zip(got.iter().chain(&got_chunks))
                .zip(&top20)
                .map(|((w, g), top)| {
                    let (wt, gt): (Vec<f32>, Vec<f32>) = top.iter().map(|&i| (w[i], g[i])).unzip();
                    max_abs(&wt, &gt)
                })
                .fold(0f32, f32::max);
            let worst = d.max_kl.max(dc.max_kl);
            let (kl_mean, kl_max, diff_max) = if dtype == KvDtype::Int8 { int8 } else { fine };
            eprintln!(
                "{name} {kname:>6} kv {dtype:?}: decode KL mean {:.2e} p99 {:.2e} max {:.2e}, \
                 top-1 {:.3}; chunks KL max {:.2e}, top-1 {:.3}; top-20 |dlogp| max {top_diff:.3}",
                d.mean_kl, d.p99_kl, d.max_kl, d.top1_agreement, dc.max_kl, dc.top1_agreement
            );
            if d.mean_kl > kl_mean || worst > kl_max || top_diff > diff_max {
                failures.push(format!(
                    "{name} {kname} kv {dtype:?}: KL mean {:.2e} (bound {kl_mean:.0e}), \
                     max {worst:.2e} (bound {kl_max:.0e}), top-20 |dlogp| {top_diff:.3} \
                     (bound {diff_max})",
                    d.mean_kl
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "kernels depart from the f32 reference:\n{}",
        failures.join("\n")
    );
}

#[test]
fn every_kernel_and_kv_dtype_stays_near_the_reference_on_the_default_model() {
    check_model(
        "SmolLM2",
        &flotilla_hub::test_model_path(),
        (1e-2, 1e-1, 1.0),
    );
}

#[test]
fn every_kernel_and_kv_dtype_stays_near_the_reference_on_gemma3() {
    check_model(
        "Gemma3",
        &flotilla_hub::test_gemma3_path(),
        (1e-2, 1e-1, 1.0),
    );
}

/// At size (Qwen2.5-Coder 0.5B in CI, the 1.5B with `FLOTILLA_TEST_QWEN`):
/// the best kernel this CPU has (the others are held to the reference on
/// the small models above), with both K-quant layouts where it is AVX-512
/// VNNI, every KV dtype. f32 and f16 KV within KL max
/// 2e-2 (4.2e-3 seen on an AMD EPYC with AVX-512); int8 KV within the small
/// models' bounds plus half (8.2e-2 and 0.80 seen). Qwen2's keys carry a
/// few large channels (its K bias: 100-200 beside 1-10), so an int8 cache
/// that quantised them as they are departs by itself: KL max 0.32 before
/// the cache rotated its rows (`kvcache::int8_rotations`).
#[test]
fn the_best_kernel_and_every_kv_dtype_stay_near_the_reference_on_qwen25_coder() {
    let best = best_kernel();
    check_kernels(
        "Qwen2.5-Coder",
        &flotilla_hub::test_qwen_path(),
        &best,
        (5e-3, 2e-2, 0.5),
        (1e-2, 1.5e-1, 1.5),
    );
}

/// Chat prompts through the model's own template (special tokens, the
/// beginning-of-text token), as a served request begins.
fn chat_prompts(path: &std::path::Path) -> Vec<Vec<u32>> {
    use flotilla_text::chat::ChatMessage;
    let g = flotilla_gguf::GgufFile::open(path).unwrap();
    let side = flotilla_text::TextSide::from_gguf(&g).unwrap();
    let chat = side.chat.as_ref().expect("the model has a chat template");
    [
        "Write a haiku about the sea.",
        "Write a Python function that returns the n-th Fibonacci number.",
        "What is the capital of Australia, and why is it not Sydney?",
    ]
    .iter()
    .map(|q| {
        let text = chat.render(&[ChatMessage::new("user", *q)], true).unwrap();
        side.tokenizer.encode(&text, true).unwrap()
    })
    .collect()
}

/// The exact path's greedy continuation of `prompt` (`n` tokens) and its
/// log-probabilities at each step.
fn exact_greedy(
    e: &mut CpuExecutor,
    prompt: &[u32],
    n: usize,
    table: &[u32],
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut ids = prompt.to_vec();
    let (mut toks, mut rows) = (Vec::new(), Vec::new());
    let mut start = 0;
    for _ in 0..n {
        let row = log_softmax(&common::step_logits(e, &ids, start, table));
        let t = common::argmax(&row) as u32;
        start = ids.len();
        ids.push(t);
        toks.push(t);
        rows.push(row);
    }
    (toks, rows)
}

/// Free-running greedy continuations of prompts cut from real text, each
/// kernel x KV dtype against the exact path's: they may part only where
/// the exact path's top token leads the kernel's choice by at most
/// `margin` nats (a near-tie may go either way; a clear choice may not).
/// After a parting the contexts differ, so the comparison stops there, as
/// the greedy parity checks against llama.cpp do.
fn greedy_departures(name: &str, path: &std::path::Path, margin: f32) {
    greedy_departures_of(name, path, &kernels(), margin);
}

/// [`greedy_departures`] for `kernels`.
fn greedy_departures_of(name: &str, path: &std::path::Path, kernels: &[KernelCase], margin: f32) {
    let all = tokens(path);
    let chats = chat_prompts(path);
    let mut prompts: Vec<&[u32]> = vec![&all[0..24], &all[30..POSITIONS]];
    prompts.extend(chats.iter().map(|c| c.as_slice()));
    const NEW: usize = 16;
    let table: Vec<u32> = (0..(POSITIONS + NEW).div_ceil(16) as u32).collect();
    let mut reference = exec(path, Kernel::Exact, KvDtype::F32);
    let want: Vec<(Vec<u32>, Vec<Vec<f32>>)> = prompts
        .iter()
        .map(|p| exact_greedy(&mut reference, p, NEW, &table))
        .collect();
    drop(reference);
    let mut failures = Vec::new();
    // Each SIMD kernel with the served KV dtypes.
    for &(kname, kernel, compact) in kernels {
        for dtype in [KvDtype::F16, KvDtype::Int8] {
            let mut e = exec_with(path, kernel, compact, dtype);
            let mut equal = 0;
            for (pi, (p, (wt, wl))) in prompts.iter().zip(&want).enumerate() {
                let got = flotilla_model::testutil::plain_decode(
                    &mut e,
                    p,
                    flotilla_model::SamplingParams::greedy(),
                    NEW,
                    &table,
                );
                let same = got.iter().zip(wt).take_while(|(a, b)| a == b).count();
                equal += same;
                if same < NEW {
                    let row = &wl[same];
                    let gap = row[wt[same] as usize] - row[got[same] as usize];
                    eprintln!(
                        "{name} {kname:>6} kv {dtype:?} prompt {pi}: parts at token {same} \
                         ({gap:.3} nats below the reference's top)"
                    );
                    if gap > margin {
                        failures.push(format!(
                            "{name} {kname} kv {dtype:?} prompt {pi} token {same}: chose {}, \
                             {gap:.2} nats below the reference's {}",
                            got[same], wt[same]
                        ));
                    }
                }
            }
            eprintln!(
                "{name} {kname:>6} kv {dtype:?}: {equal} of {} greedy tokens as the reference's before any parting",
                NEW * prompts.len()
            );
        }
    }
    assert!(
        failures.is_empty(),
        "greedy choices depart from the f32 reference:\n{}",
        failures.join("\n")
    );
}

#[test]
fn greedy_choices_are_the_references_up_to_near_ties_on_the_default_model() {
    greedy_departures("SmolLM2", &flotilla_hub::test_model_path(), 1.0);
}

/// At size: the best kernel this CPU has (see above). Not in CI's run (it
/// takes 70-120 s there, on top of the teacher-forced check above, which
/// holds the same paths at size): run it with `cargo nextest run -p
/// flotilla-model --test kernel_parity --run-ignored all qwen`.
#[test]
#[ignore = "at size, ~70 s: the teacher-forced check runs in CI; run with --run-ignored"]
fn greedy_choices_are_the_references_up_to_near_ties_on_qwen25_coder() {
    let best = best_kernel();
    greedy_departures_of("Qwen2.5-Coder", &flotilla_hub::test_qwen_path(), &best, 1.0);
}

#[test]
fn greedy_choices_are_the_references_up_to_near_ties_on_gemma3() {
    greedy_departures("Gemma3", &flotilla_hub::test_gemma3_path(), 1.0);
}
