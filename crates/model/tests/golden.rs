//! The forward pass against an independent f64 numpy reference
//! (tests/reference/reference.py), greedy continuations, batch invariance and
//! paged-KV invariance, on the default model.

use std::path::PathBuf;

use flotilla_model::generate::{Driver, Request};
use flotilla_model::kernels::Kernel;
use flotilla_model::testutil::one_seq;
use flotilla_model::{
    CpuConfig, CpuExecutor, Executor, KvDtype, OutputKind, SamplingParams, SeqInput, StepOutputs,
};
use serde::Deserialize;

mod common;
use common::argmax;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn exec(kernel: Kernel, kv_dtype: KvDtype, threads: usize) -> CpuExecutor {
    let cfg = CpuConfig {
        kernel,
        kv_dtype,
        threads,
        num_blocks: 96,
        max_batch_tokens: 256,
        ..Default::default()
    };
    CpuExecutor::load(&flotilla_hub::test_model_path(), &cfg).expect("load the default model")
}

#[derive(Deserialize)]
struct Golden {
    name: String,
    ids: Vec<u32>,
    positions: Vec<usize>,
    file: String,
}

fn golden() -> Vec<(Golden, Vec<Vec<f32>>)> {
    let text = std::fs::read_to_string(fixtures().join("golden_logits.json")).unwrap();
    let cases: Vec<Golden> = serde_json::from_str(&text).unwrap();
    cases
        .into_iter()
        .map(|c| {
            let f = common::read_f32(&fixtures().join(&c.file));
            let vocab = f.len() / c.positions.len();
            let rows = f.chunks(vocab).map(|r| r.to_vec()).collect();
            (c, rows)
        })
        .collect()
}

/// Logits at each of `positions` (ascending), running the prompt as
/// consecutive prefill chunks that end at those positions.
fn logits_at(e: &mut CpuExecutor, ids: &[u32], positions: &[usize]) -> Vec<Vec<f32>> {
    let table: Vec<u32> = (0..ids.len().div_ceil(16) as u32).collect();
    common::logits_at(e, ids, positions, &table)
}

fn top2_gap(v: &[f32]) -> f32 {
    let a = argmax(v);
    let second = v
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != a)
        .fold(f32::MIN, |m, (_, &x)| m.max(x));
    v[a] - second
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// Exact path (f32 weights dequantised, f32 activations, f32 KV): tight.
#[test]
fn exact_path_matches_reference_logits() {
    let mut e = exec(Kernel::Exact, KvDtype::F32, 2);
    for (c, want) in golden() {
        let got = logits_at(&mut e, &c.ids, &c.positions);
        for (g, w) in got.iter().zip(&want) {
            let d = max_abs_diff(g, w);
            eprintln!("{}: exact max |diff| = {d:.2e}", c.name);
            assert!(
                d < 2e-3,
                "{}: exact path departs from the reference by {d}",
                c.name
            );
            assert_eq!(argmax(g), argmax(w), "{}", c.name);
        }
    }
}

/// Fast path (8-bit activations, f16 KV, SIMD): loose, argmax equal unless near-tie.
///
/// Measured on these prompts: max |diff| up to 0.98, mean 0.09 to 0.17 logits
/// (the figures move with the order of float sums inside the kernels),
/// almost all of it from quantising activations to 8 bits per 32 values (the
/// same scheme llama.cpp uses for Q4_1 and Q8_0 weights; f32 KV or an exact
/// output head change it by under 0.02). The reference's own emulation of
/// that rounding moves logits by up to 1.27 (tests/reference/README.md), and
/// llama.cpp's logprobs differ from the reference by up to 0.69.
#[test]
fn fast_path_matches_reference_logits() {
    let mut e = exec(Kernel::Auto, KvDtype::F16, 2);
    for (c, want) in golden() {
        let got = logits_at(&mut e, &c.ids, &c.positions);
        for (g, w) in got.iter().zip(&want) {
            // A shift of every logit by one constant changes no probability:
            // compare the differences with their mean removed.
            let shift: f32 = g.iter().zip(w).map(|(x, y)| x - y).sum::<f32>() / g.len() as f32;
            let centred: Vec<f32> = g.iter().map(|x| x - shift).collect();
            let d = max_abs_diff(&centred, w);
            let mean: f32 = centred
                .iter()
                .zip(w)
                .map(|(x, y)| (x - y).abs())
                .sum::<f32>()
                / g.len() as f32;
            eprintln!(
                "{}: fast max |diff| = {d:.3}, mean {mean:.4} (after removing a shift of {shift:.3})",
                c.name
            );
            assert!(
                d < 1.3 && mean < 0.25,
                "{}: fast path departs: max {d}, mean {mean}",
                c.name
            );
            if top2_gap(w) >= 0.3 {
                assert_eq!(argmax(g), argmax(w), "{}", c.name);
            }
        }
    }
}

#[derive(Deserialize)]
struct Greedy {
    name: String,
    prompt_ids: Vec<u32>,
    tokens: Vec<u32>,
    gaps: Vec<f32>,
}

fn greedy_cases() -> Vec<Greedy> {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("greedy.json")).unwrap()).unwrap()
}

/// Checks a continuation against the reference: equal until the end, or
/// until a step where the reference's top-2 gap was below `near_tie`.
fn check_continuation(name: &str, got: &[u32], case: &Greedy, near_tie: f32) {
    for (i, (&g, &w)) in got.iter().zip(&case.tokens).enumerate() {
        if g != w {
            assert!(
                case.gaps[i] < near_tie,
                "{name}: token {i} is {g}, reference {w}, and the reference gap {} is no near-tie",
                case.gaps[i]
            );
            eprintln!(
                "{name}: departs at a near-tie at token {i} (gap {:.3})",
                case.gaps[i]
            );
            return;
        }
    }
    assert_eq!(got.len(), case.tokens.len(), "{name}: stopped early");
}

fn greedy_request(c: &Greedy) -> Request {
    Request {
        prompt: c.prompt_ids.clone(),
        params: SamplingParams::greedy(),
        max_new: c.tokens.len(),
        stop_tokens: vec![],
    }
}

/// The exact path holds the rule: departures only where the
/// reference's top-2 gap is below 0.3 logits.
#[test]
fn greedy_continuations_match_reference_exact_path() {
    let cases = greedy_cases();
    assert!(cases.len() >= 8);
    let mut d = Driver::new(exec(Kernel::Exact, KvDtype::F32, 2));
    let reqs: Vec<Request> = cases.iter().map(greedy_request).collect();
    let out = d.run(&reqs, |_, _| {}).unwrap();
    for (c, (got, _)) in cases.iter().zip(&out) {
        check_continuation(&c.name, got, c, 0.3);
    }
    assert_eq!(d.free_blocks(), 96, "every block is given back");
}

/// The fast path carries 8-bit activation error of up to ~0.35 logits in a
/// top-2 difference (see `fast_path_matches_reference_logits`); it departed
/// once, at a reference gap of 0.31 (raw_story, token 17), where llama.cpp
/// happens not to. Allowed: departures at gaps below 0.35.
#[test]
fn greedy_continuations_match_reference_fast_path() {
    let cases = greedy_cases();
    let mut d = Driver::new(exec(Kernel::Auto, KvDtype::F16, 2));
    for c in &cases {
        let out = d.run(&[greedy_request(c)], |_, _| {}).unwrap();
        check_continuation(&c.name, &out[0].0, c, 0.35);
    }
    assert_eq!(d.free_blocks(), 96, "every block is given back");
}

/// All greedy prompts at once: prefill chunks of some sequences run in the
/// same steps as decodes of others; tokens equal the one-at-a-time run.
#[test]
fn mixed_batches_give_the_same_tokens_as_single_runs() {
    let cases = greedy_cases();
    let reqs: Vec<Request> = cases.iter().map(greedy_request).collect();
    for kv_dtype in [KvDtype::F16, KvDtype::Int8] {
        let cfg = CpuConfig {
            num_blocks: 96,
            max_batch_tokens: 48,
            threads: 2,
            kv_dtype,
            ..Default::default()
        };
        let e = CpuExecutor::load(&flotilla_hub::test_model_path(), &cfg).unwrap();
        let mut d = Driver::new(e);
        let alone: Vec<Vec<u32>> = reqs
            .iter()
            .map(|r| {
                d.run(std::slice::from_ref(r), |_, _| {}).unwrap()[0]
                    .0
                    .clone()
            })
            .collect();
        // A 48-token budget forces prompts to split into chunks that share steps with decodes.
        let together = d.run(&reqs, |_, _| {}).unwrap();
        for ((a, (t, _)), c) in alone.iter().zip(&together).zip(&cases) {
            assert_eq!(
                a, t,
                "{kv_dtype}: {}: batched run differs from the run alone",
                c.name
            );
        }
        assert_eq!(d.free_blocks(), 96);
    }
}

/// Physical blocks in shuffled order give bit-identical logits to contiguous ones.
#[test]
fn shuffled_blocks_give_identical_logits() {
    for kv_dtype in [KvDtype::F16, KvDtype::Int8] {
        shuffled_blocks_give_identical_logits_with(kv_dtype);
    }
}

fn shuffled_blocks_give_identical_logits_with(kv_dtype: KvDtype) {
    let (c, _) = golden().into_iter().next().unwrap();
    let mut e = exec(Kernel::Auto, kv_dtype, 2);
    let n = c.ids.len().div_ceil(16);
    let contiguous: Vec<u32> = (0..n as u32).collect();
    let shuffled: Vec<u32> = (0..n as u32).map(|i| 90 - 7 * i).collect();
    let mut out = StepOutputs::default();
    let mut run = |table: &[u32], e: &mut CpuExecutor| {
        // Prefill in two chunks, then one decode token.
        let k = c.ids.len() - 1;
        for (s, t) in [(0, 10), (10, k)] {
            let b = [SeqInput {
                tokens: &c.ids[s..t],
                start_pos: s,
                block_table: table,
                output: OutputKind::None,
                bias: &[],
                draft_bias: &[],
                allow: None,
            }];
            e.step(&b, &mut out).unwrap();
        }
        let b = [SeqInput {
            tokens: &c.ids[k..],
            start_pos: k,
            block_table: table,
            output: OutputKind::Logits,
            bias: &[],
            draft_bias: &[],
            allow: None,
        }];
        e.step(&b, &mut out).unwrap();
        out.logits_of(0).unwrap().to_vec()
    };
    let a = run(&contiguous, &mut e);
    let b = run(&shuffled, &mut e);
    assert_eq!(a, b, "{kv_dtype}");
}

#[test]
fn bad_batches_are_refused_without_panic() {
    let mut e = exec(Kernel::Auto, KvDtype::F16, 1);
    let mut out = StepOutputs::default();
    let t = [0u32, 1];
    let cases: Vec<(Vec<SeqInput<'_>>, &str)> = vec![
        (vec![], "empty"),
        (
            vec![SeqInput {
                tokens: &[70000],
                start_pos: 0,
                block_table: &t,
                output: OutputKind::Logits,
                bias: &[],
                draft_bias: &[],
                allow: None,
            }],
            "vocabulary",
        ),
        (
            vec![SeqInput {
                tokens: &[1],
                start_pos: 40,
                block_table: &t,
                output: OutputKind::Logits,
                bias: &[],
                draft_bias: &[],
                allow: None,
            }],
            "block table",
        ),
        (
            vec![SeqInput {
                tokens: &[1],
                start_pos: 0,
                block_table: &[500],
                output: OutputKind::Logits,
                bias: &[],
                draft_bias: &[],
                allow: None,
            }],
            "block 500",
        ),
        (
            vec![SeqInput {
                tokens: &[1],
                start_pos: 9000,
                block_table: &t,
                output: OutputKind::Logits,
                bias: &[],
                draft_bias: &[],
                allow: None,
            }],
            "context",
        ),
        (
            vec![
                SeqInput {
                    tokens: &[1, 2],
                    start_pos: 0,
                    block_table: &t,
                    output: OutputKind::None,
                    bias: &[],
                    draft_bias: &[],
                    allow: None,
                },
                SeqInput {
                    tokens: &[3],
                    start_pos: 1,
                    block_table: &t,
                    output: OutputKind::None,
                    bias: &[],
                    draft_bias: &[],
                    allow: None,
                },
            ],
            "another position",
        ),
        (
            vec![SeqInput {
                tokens: &[1],
                start_pos: 0,
                block_table: &t,
                output: OutputKind::Sample(SamplingParams {
                    top_p: 0.0,
                    ..Default::default()
                }),
                bias: &[],
                draft_bias: &[],
                allow: None,
            }],
            "top_p",
        ),
    ];
    for (batch, needle) in cases {
        let err = e.step(&batch, &mut out).unwrap_err().to_string();
        assert!(
            err.contains(needle),
            "expected an error about {needle}, got: {err}"
        );
    }
    // The executor still works afterwards.
    let ok = [SeqInput {
        tokens: &[1, 2, 3],
        start_pos: 0,
        block_table: &t,
        output: OutputKind::Logits,
        bias: &[],
        draft_bias: &[],
        allow: None,
    }];
    e.step(&ok, &mut out).unwrap();
    assert!(out.logits_of(0).unwrap().iter().all(|v| v.is_finite()));
}

/// Export then import of a block reproduces the same continuation (the
/// migration path of disaggregated serving).
#[test]
fn block_export_import_round_trips() {
    for kv_dtype in [KvDtype::F16, KvDtype::Int8] {
        block_export_import_round_trips_with(kv_dtype);
    }
}

fn block_export_import_round_trips_with(kv_dtype: KvDtype) {
    let (c, _) = golden().into_iter().next().unwrap();
    let mut e = exec(Kernel::Auto, kv_dtype, 1);
    let n = c.ids.len().div_ceil(16);
    let src: Vec<u32> = (0..n as u32).collect();
    let dst: Vec<u32> = (50..50 + n as u32).collect();
    let k = c.ids.len() - 1;
    let mut out = StepOutputs::default();
    e.step(&one_seq(&c.ids[..k], 0, OutputKind::None, &src), &mut out)
        .unwrap();
    let bytes = e.kv_spec().bytes_per_block;
    assert_eq!(
        bytes,
        kv_dtype.bytes_per_block(30, 3, 64, 16),
        "SmolLM2-135M: 30 layers, 3 KV heads of 64"
    );
    let mut buf = vec![0u8; bytes];
    for (&a, &b) in src.iter().zip(&dst) {
        e.read_block(a, &mut buf).unwrap();
        e.write_block(b, &buf).unwrap();
    }
    let last = |table: &[u32], e: &mut CpuExecutor, out: &mut StepOutputs| {
        e.step(&one_seq(&c.ids[k..], k, OutputKind::Logits, table), out)
            .unwrap();
        out.logits_of(0).unwrap().to_vec()
    };
    let a = last(&src, &mut e, &mut out);
    let b = last(&dst, &mut e, &mut out);
    assert_eq!(a, b, "{kv_dtype}");
    assert!(e.write_block(0, &buf[1..]).is_err());
    assert!(e.read_block(10_000, &mut buf).is_err());

    // Through the KV offload tier (in RAM, then in a file): spilled out of
    // the blocks the prefix was computed in, overwritten there by another
    // prompt, restored into other blocks, the prefix gives the logits of
    // the one computed in place.
    let file = std::env::temp_dir().join(format!("flotilla-golden-tier-{}", std::process::id()));
    for path in [None, Some(file.as_path())] {
        let mut tier =
            flotilla_exec::OffloadTier::new(n as u32, e.offload_bytes_per_block(), path).unwrap();
        for (slot, &a) in src.iter().enumerate() {
            e.spill_block(a, tier.slot_mut(slot as u32).unwrap())
                .unwrap();
        }
        let other: Vec<u32> = c.ids[..k].iter().rev().copied().collect();
        e.step(&one_seq(&other, 0, OutputKind::None, &src), &mut out)
            .unwrap();
        assert_ne!(
            last(&src, &mut e, &mut out),
            a,
            "the prefix's blocks were overwritten"
        );
        let back: Vec<u32> = (70..70 + n as u32).collect();
        for (slot, &b) in back.iter().enumerate() {
            e.restore_block(tier.slot(slot as u32).unwrap(), b).unwrap();
        }
        assert_eq!(
            last(&back, &mut e, &mut out),
            a,
            "{kv_dtype}, file {path:?}"
        );
        // The computed prefix back in `src` for the next round.
        for (&s, &b) in src.iter().zip(&back) {
            e.read_block(b, &mut buf).unwrap();
            e.write_block(s, &buf).unwrap();
        }
    }
    let _ = std::fs::remove_file(&file);
}

/// The chat template from the file, rendered and tokenized by this crate,
/// gives llama.cpp's ids for the chat prompts of the greedy fixture.
#[test]
fn chat_prompts_tokenize_like_llama_cpp() {
    let g = flotilla_gguf::GgufFile::open(&flotilla_hub::test_model_path()).unwrap();
    let text = flotilla_text::TextSide::from_gguf(&g).unwrap();
    let tpl = text
        .chat
        .as_ref()
        .expect("the default model has a chat template");
    #[derive(Deserialize)]
    struct C {
        chat: bool,
        text: String,
        prompt_ids: Vec<u32>,
    }
    let cases: Vec<C> =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("greedy.json")).unwrap())
            .unwrap();
    let mut n = 0;
    for c in cases.iter().filter(|c| c.chat) {
        let rendered = tpl
            .render(
                &[flotilla_text::chat::ChatMessage::new(
                    "user",
                    c.text.clone(),
                )],
                true,
            )
            .unwrap();
        assert_eq!(
            text.tokenizer.encode(&rendered, true).unwrap(),
            c.prompt_ids,
            "{rendered:?}"
        );
        n += 1;
    }
    assert!(n >= 4);
    assert!(
        text.stop_tokens.contains(&2),
        "EOS / <|im_end|> stops generation"
    );
}

/// Every path of the driver gives its blocks back: running out of blocks
/// (no preemption here) and a step the executor refuses.
#[test]
fn driver_returns_blocks_on_every_path() {
    let cfg = CpuConfig {
        num_blocks: 4,
        max_batch_tokens: 64,
        threads: 1,
        ..Default::default()
    };
    let e = CpuExecutor::load(&flotilla_hub::test_model_path(), &cfg).unwrap();
    let mut d = Driver::new(e);
    let req = |first: u32| Request {
        prompt: (first..first + 30).collect(),
        params: SamplingParams::greedy(),
        max_new: 20,
        stop_tokens: vec![],
    };
    let err = d.run(&[req(100), req(200)], |_, _| {}).unwrap_err();
    assert!(
        matches!(
            err,
            flotilla_model::generate::DriverError::OutOfBlocks {
                running: 2,
                blocks: 4
            }
        ),
        "{err}"
    );
    assert_eq!(d.free_blocks(), 4);
    let bad = Request {
        prompt: vec![5, 70_000],
        ..req(0)
    };
    assert!(
        d.run(&[bad], |_, _| {})
            .unwrap_err()
            .to_string()
            .contains("vocabulary")
    );
    assert_eq!(d.free_blocks(), 4);
    // Alone, each fits and completes.
    let out = d.run(&[req(100)], |_, _| {}).unwrap();
    assert_eq!(out[0].0.len(), 20);
    assert_eq!(d.free_blocks(), 4);
}

/// The int8 KV cache (8-bit values, an f16 scale per 32) beside f16: the
/// greedy continuations of the golden prompts are f16's, except from a
/// step where f16's own top-2 gap is a near-tie (below 0.35 logits, the
/// fast path's activation noise).
#[test]
fn int8_kv_greedy_continuations_equal_f16_except_at_near_ties() {
    let cases = greedy_cases();
    let reqs: Vec<Request> = cases.iter().map(greedy_request).collect();
    let run = |kv_dtype| {
        let mut d = Driver::new(exec(Kernel::Auto, kv_dtype, 2));
        let out = d.run(&reqs, |_, _| {}).unwrap();
        assert_eq!(d.free_blocks(), 96, "every block is given back");
        out
    };
    let (f16, int8) = (run(KvDtype::F16), run(KvDtype::Int8));
    let mut e = exec(Kernel::Auto, KvDtype::F16, 2);
    let table: Vec<u32> = (0..96).collect();
    let mut out = StepOutputs::default();
    let mut departures = 0;
    // (This small model's greedy text is full of near-ties: in the run
    // that set this test up, 7 of 9 departed, at f16 gaps of 0.05-0.22.)
    for ((c, (a, _)), (b, _)) in cases.iter().zip(&f16).zip(&int8) {
        let Some(i) = a.iter().zip(b).position(|(x, y)| x != y) else {
            assert_eq!(a.len(), b.len(), "{}: stopped at another length", c.name);
            continue;
        };
        departures += 1;
        let ids: Vec<u32> = c.prompt_ids.iter().chain(&a[..i]).copied().collect();
        e.step(
            &[SeqInput {
                tokens: &ids,
                start_pos: 0,
                block_table: &table,
                output: OutputKind::Logits,
                bias: &[],
                draft_bias: &[],
                allow: None,
            }],
            &mut out,
        )
        .unwrap();
        let mut l = out.logits_of(0).unwrap().to_vec();
        l.sort_by(|x, y| y.total_cmp(x));
        let gap = l[0] - l[1];
        eprintln!("{}: int8 departs at token {i} (f16 gap {gap:.3})", c.name);
        assert!(
            gap < 0.35,
            "{}: int8 KV departs from f16 KV at token {i} where f16's top-2 gap {gap} is no near-tie",
            c.name
        );
    }
    eprintln!(
        "{departures} of {} continuations depart, each at a near-tie",
        cases.len()
    );
}

/// Teacher-forced over 256 tokens of natural text, the int8 cache's
/// next-token distributions stay as close to f16's as the 8-bit
/// activations let any change of the cache (an f32 cache, more precise,
/// moves them about as far: bench-kv-quality reports both): mean KL below
/// 0.01 and within 2x of f32's, top-1 agreement at least 90%. A wrong
/// scale or layout gives KL in whole nats.
#[test]
fn int8_kv_distributions_stay_within_the_noise_of_any_cache_change() {
    use flotilla_model::quality::{divergence, teacher_forced_logprobs};
    let g = flotilla_gguf::GgufFile::open(&flotilla_hub::test_model_path()).unwrap();
    let side = flotilla_text::TextSide::from_gguf(&g).unwrap();
    let text = std::fs::read_to_string(fixtures().join("kv_quality.txt")).unwrap();
    let ids = side.tokenizer.encode(&text, false).unwrap();
    let tokens = &ids[..256];
    let run = |kv_dtype| {
        let mut e = exec(Kernel::Auto, kv_dtype, 2);
        teacher_forced_logprobs(&mut e, tokens).unwrap()
    };
    let reference = run(KvDtype::F16);
    let d8 = divergence(&reference, &run(KvDtype::Int8), |_| true);
    let d32 = divergence(&reference, &run(KvDtype::F32), |_| true);
    eprintln!("int8 vs f16: {d8:?}\nf32 vs f16: {d32:?}");
    assert!(d8.mean_kl < 0.01, "{d8:?}");
    assert!(
        d8.mean_kl <= 2.0 * d32.mean_kl + 1e-4,
        "int8 {d8:?}, f32 {d32:?}"
    );
    assert!(d8.top1_agreement >= 0.9, "{d8:?}");
}
