//! Every architecture piece against an independent f64 numpy reference, on
//! tiny random-weight GGUF files that `tests/reference/tiny.py` writes with
//! the `gguf` Python package: Llama 3 (frequency factors, separate head),
//! Qwen2 (Q/K/V biases, NEOX RoPE), Gemma 3 (sliding windows, QK-norm, post
//! norms, GeGLU, embedding scale, local RoPE base, q_dim != n_embd) and plain
//! Llama; and their tokenizers against llama.cpp's ids on the same files.
//!
//! Needs Python with numpy and gguf: `FLOTILLA_PYTHON`, else the tests' own
//! environment, made on first use (`flotilla_hub::test_python`); a machine
//! without Python 3 fails with what to install.

use std::path::{Path, PathBuf};
use std::process::Command;

use flotilla_model::kernels::Kernel;
use flotilla_model::{
    CpuConfig, CpuExecutor, Executor, KvDtype, OutputKind, SeqInput, StepOutputs,
};
use serde::Deserialize;

mod common;

const ARCHS: [&str; 4] = ["llama3", "qwen2", "gemma3", "llama"];

#[derive(Deserialize)]
struct Expected {
    tokenizer: TokInfo,
    cases: Vec<Case>,
    greedy: Greedy,
}

#[derive(Deserialize)]
struct TokInfo {
    vocab_sha256: String,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    ids: Vec<u32>,
    logits_all_positions: Vec<Vec<f64>>,
}

#[derive(Deserialize)]
struct Greedy {
    prompt_ids: Vec<u32>,
    tokens: Vec<u32>,
}

#[derive(Deserialize)]
struct TokFixture {
    vocab_sha256: String,
    tokenize: Vec<TokCase>,
}

#[derive(Deserialize)]
struct TokCase {
    text: String,
    ids: Vec<u32>,
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Writes the tiny model of `arch` into a directory of its own for `test`.
fn generate(arch: &str, test: &str) -> (PathBuf, Expected) {
    let python = flotilla_hub::test_python()
        .unwrap_or_else(|e| panic!("the tiny-model references cannot run: {e}"))
        .to_string_lossy()
        .into_owned();
    let dir = std::env::temp_dir().join(format!(
        "flotilla-tiny-{arch}-{test}-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let out = Command::new(&python)
        .arg(repo().join("tests/reference/tiny.py"))
        .args(["--arch", arch, "--no-ablations", "--out"])
        .arg(&dir)
        .output();
    let ok = matches!(&out, Ok(o) if o.status.success());
    if !ok {
        let why = match &out {
            Ok(o) => String::from_utf8_lossy(&o.stderr).into_owned(),
            Err(e) => e.to_string(),
        };
        panic!("{python} cannot run tests/reference/tiny.py (it needs numpy and gguf): {why}");
    }
    let e: Expected =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    (dir, e)
}

fn exec(path: &Path, kernel: Kernel) -> CpuExecutor {
    exec_kv(path, kernel, KvDtype::F32)
}

fn exec_kv(path: &Path, kernel: Kernel, kv_dtype: KvDtype) -> CpuExecutor {
    let cfg = CpuConfig {
        kernel,
        kv_dtype,
        threads: 2,
        // Small blocks, so that Gemma's window of 4 starts inside blocks.
        block_size: 4,
        num_blocks: 64,
        max_batch_tokens: 64,
        layout_cache: None,
        compact_k_quants: false,
        head_rows: 0,
    };
    CpuExecutor::load(&path.join("model.gguf"), &cfg).expect("load the tiny model")
}

fn max_abs_diff(a: &[f32], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .fold(0f64, |m, (x, y)| m.max((*x as f64 - y).abs()))
}

fn argmax(v: &[f32]) -> u32 {
    common::argmax(v) as u32
}

/// Runs `ids` as prefill chunks of `chunk` tokens through `table`, returning
/// the logits after each chunk (positions `chunk-1, 2*chunk-1, ..., last`).
fn chunked(
    e: &mut CpuExecutor,
    ids: &[u32],
    chunk: usize,
    table: &[u32],
) -> Vec<(usize, Vec<f32>)> {
    let ends: Vec<usize> = (1..=ids.len().div_ceil(chunk))
        .map(|i| (i * chunk).min(ids.len()) - 1)
        .collect();
    let rows = common::logits_at(e, ids, &ends, table);
    ends.into_iter().zip(rows).collect()
}

/// Every case's logits at every position, in one prefill and in chunks of 3
/// and 1 over `table`, each within `bound` of the reference; returns the
/// largest difference seen.
fn worst_against_reference(
    e: &mut CpuExecutor,
    want: &Expected,
    table: &[u32],
    bound: f64,
    what: &str,
) -> f64 {
    let mut worst = 0f64;
    for c in &want.cases {
        for chunk in [c.ids.len(), 3, 1] {
            for (pos, got) in chunked(e, &c.ids, chunk, table) {
                let d = max_abs_diff(&got, &c.logits_all_positions[pos]);
                worst = worst.max(d);
                assert!(
                    d < bound,
                    "{what} {} at position {pos} (chunks of {chunk}): max |logit - ref| = {d} \
                     (bound {bound})",
                    c.name
                );
            }
        }
    }
    worst
}

/// The exact path (f32 weights and activations, f32 KV) matches the f64
/// reference at every position, in one prefill and in chunks over a shuffled
/// block table; greedy decoding through the KV cache gives its tokens.
#[test]
fn every_architecture_matches_the_reference() {
    for arch in ARCHS {
        let (dir, want) = generate(arch, "reference");
        let mut e = exec(&dir, Kernel::Exact);
        let table: Vec<u32> = vec![9, 3, 17, 0, 41, 5, 12, 30, 2, 7];
        let worst = worst_against_reference(&mut e, &want, &table, 1e-3, arch);
        eprintln!("{arch}: worst max |logit - ref| = {worst:.2e}");
        // Greedy, one token at a time after the prompt.
        let g = &want.greedy;
        let mut ids = g.prompt_ids.clone();
        let mut out = StepOutputs::default();
        let mut start = 0;
        for (step, &expect) in g.tokens.iter().enumerate() {
            let batch = [SeqInput {
                tokens: &ids[start..],
                start_pos: start,
                block_table: &table,
                output: OutputKind::Logits,
                bias: &[],
                draft_bias: &[],
                allow: None,
            }];
            e.step(&batch, &mut out).unwrap();
            let next = argmax(out.logits_of(0).unwrap());
            assert_eq!(next, expect, "{arch}: greedy step {step}");
            start = ids.len();
            ids.push(next);
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// Every SIMD kernel this CPU has, with every KV dtype, against the same
/// f64 reference (issue 43: a SIMD path that departs must fail where the
/// CPU has it). The tiny files' matrices are f32 and f16, which the SIMD
/// kernels multiply in f32 (no 8-bit activations), so the bound is tight
/// for an f32 cache (1e-4; measured <= 5.6e-6 on an AMD EPYC, AVX2 and
/// AVX-512 alike) and the cache's own rounding otherwise (f16 2e-2,
/// measured <= 8.5e-3; int8, where the head dimension allows it, 0.2,
/// measured 0.133).
#[test]
fn every_simd_kernel_and_kv_dtype_matches_the_reference() {
    let kernels: Vec<(&str, Kernel)> = [("avx2", Kernel::Avx2), ("avx512", Kernel::Avx512)]
        .into_iter()
        .filter(|(name, k)| {
            let ok = k.supported();
            if !ok {
                eprintln!("kernel {name}: not on this CPU, not checked here");
            }
            ok
        })
        .collect();
    for arch in ARCHS {
        let (dir, want) = generate(arch, "simd");
        let table: Vec<u32> = vec![9, 3, 17, 0, 41, 5, 12, 30, 2, 7];
        // An int8 cache groups 32 values per scale: only files whose head
        // dimension is a multiple of 32 can have one.
        let g = flotilla_gguf::GgufFile::open(&dir.join("model.gguf")).unwrap();
        let hd = flotilla_model::arch::ModelConfig::from_gguf(&g)
            .unwrap()
            .head_dim;
        for &(kname, kernel) in &kernels {
            for (dtype, bound) in [
                (KvDtype::F32, 1e-4),
                (KvDtype::F16, 2e-2),
                (KvDtype::Int8, 0.2),
            ] {
                if dtype == KvDtype::Int8 && !hd.is_multiple_of(32) {
                    continue;
                }
                let mut e = exec_kv(&dir, kernel, dtype);
                let what = format!("{arch} {kname} kv {dtype:?}");
                let worst = worst_against_reference(&mut e, &want, &table, bound, &what);
                eprintln!("{what}: worst max |logit - ref| = {worst:.2e}");
            }
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// A sequence gets the same logits alone and in a mixed batch beside other
/// sequences' prefill chunks and decodes, over different physical blocks.
#[test]
fn every_architecture_is_batch_invariant() {
    for arch in ARCHS {
        let (dir, want) = generate(arch, "batch");
        let mut e = exec(&dir, Kernel::Exact);
        let long = &want.cases.iter().max_by_key(|c| c.ids.len()).unwrap().ids;
        let alone = chunked(&mut e, long, long.len(), &[0, 1, 2, 3, 4, 5]);
        let (_, alone) = alone.last().unwrap();
        // Others first, so their KV sits in blocks 20.. and ours in 40..
        let other: Vec<u32> = long.iter().rev().copied().collect();
        let mut out = StepOutputs::default();
        e.step(
            &[SeqInput {
                tokens: &other[..7],
                start_pos: 0,
                block_table: &[20, 21, 22],
                output: OutputKind::None,
                bias: &[],
                draft_bias: &[],
                allow: None,
            }],
            &mut out,
        )
        .unwrap();
        let mine = [45u32, 40, 43, 41, 44, 42];
        let batch = [
            SeqInput {
                tokens: &other[7..8],
                start_pos: 7,
                block_table: &[20, 21, 22],
                output: OutputKind::Logits,
                bias: &[],
                draft_bias: &[],
                allow: None,
            },
            SeqInput {
                tokens: long,
                start_pos: 0,
                block_table: &mine,
                output: OutputKind::Logits,
                bias: &[],
                draft_bias: &[],
                allow: None,
            },
            SeqInput {
                tokens: &other[..5],
                start_pos: 0,
                block_table: &[30, 31],
                output: OutputKind::Logits,
                bias: &[],
                draft_bias: &[],
                allow: None,
            },
        ];
        e.step(&batch, &mut out).unwrap();
        let mixed = out.logits_of(1).unwrap();
        let d = alone
            .iter()
            .zip(mixed)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(d < 1e-5, "{arch}: alone vs mixed batch differ by {d}");
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// Token ids equal llama.cpp's `llama-tokenize` on the same tiny vocabularies
/// (byte-level BPE with the `llama-bpe` and `qwen2` pre-tokenizers, and
/// SentencePiece with and without a space prefix).
#[test]
fn every_tokenizer_matches_llama_cpp() {
    for arch in ARCHS {
        let (dir, want) = generate(arch, "tokenizer");
        let fixture: TokFixture = serde_json::from_str(
            &std::fs::read_to_string(
                repo().join(format!("tests/fixtures/tiny/{arch}.tokenize.json")),
            )
            .unwrap(),
        )
        .unwrap();
        assert_eq!(
            fixture.vocab_sha256, want.tokenizer.vocab_sha256,
            "{arch}: the fixture was made from another vocabulary"
        );
        let g = flotilla_gguf::GgufFile::open(&dir.join("model.gguf")).unwrap();
        let tok = flotilla_text::tokenizer_from_gguf(&g).unwrap();
        for c in &fixture.tokenize {
            let mut got = tok.encode(&c.text, true).unwrap();
            if tok.add_bos() {
                got.remove(0);
            }
            assert_eq!(got, c.ids, "{arch}: {:?}", c.text);
            // A SentencePiece space prefix (tiny "llama") adds a space that
            // decoding keeps; the others give the text back byte for byte.
            if arch != "llama" {
                let back = tok.decode(&got, false).unwrap();
                assert_eq!(back, c.text, "{arch}: round trip of {:?}", c.text);
            }
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
