//! Draft verification on the real model: a step that verifies draft tokens
//! samples each position exactly as plain decoding does, greedy or not, so
//! accepting the matching prefix changes no token.

use flotilla_model::testutil::{decode_with_drafts, one_seq, plain_decode};
use flotilla_model::{
    CpuConfig, CpuExecutor, Executor, KvDtype, OutputKind, SamplingParams, StepOutputs,
};

fn exec(kv_dtype: KvDtype) -> CpuExecutor {
    let cfg = CpuConfig {
        kv_dtype,
        threads: 2,
        num_blocks: 64,
        max_batch_tokens: 128,
        ..Default::default()
    };
    CpuExecutor::load(&flotilla_hub::test_model_path(), &cfg).expect("load the default model")
}

const PROMPT: [u32; 12] = [
    504, 3458, 282, 4649, 314, 7042, 30, 378, 3458, 282, 4649, 314,
];

#[test]
fn verified_drafts_give_the_tokens_of_plain_decoding() {
    let table: Vec<u32> = (0..16).collect();
    for kv_dtype in [KvDtype::F16, KvDtype::Int8] {
        let mut e = exec(kv_dtype);
        for p in [
            SamplingParams::greedy(),
            SamplingParams {
                temperature: 0.9,
                top_p: 0.95,
                seed: 7,
                ..SamplingParams::greedy()
            },
            SamplingParams {
                temperature: 1.3,
                top_k: 40,
                seed: 11,
                logprobs: true,
                ..SamplingParams::greedy()
            },
        ] {
            let reference = plain_decode(&mut e, &PROMPT, p, 40, &table);
            for (k, wrong) in [(4, 3), (7, 5), (2, 1000)] {
                let (drafted, accepted) =
                    decode_with_drafts(&mut e, &PROMPT, p, &reference, (k, wrong), &table);
                // Every wrong guess is rejected, every right one accepted.
                if wrong < drafted {
                    assert!(
                        accepted > 0 && accepted < drafted,
                        "{kv_dtype} {p:?} k={k}: {accepted} of {drafted}"
                    );
                } else {
                    assert_eq!(accepted, drafted, "{kv_dtype} {p:?} k={k}");
                }
            }
        }
    }
}

/// Presence and frequency penalties over `generated`, as a bias.
fn penalties(generated: &[u32], presence: f32, frequency: f32) -> Vec<(u32, f32)> {
    let mut counts = std::collections::BTreeMap::<u32, u32>::new();
    for &t in generated {
        *counts.entry(t).or_default() += 1;
    }
    counts
        .into_iter()
        .map(|(t, n)| (t, -(presence + frequency * n as f32)))
        .collect()
}

/// Greedy decoding of `n` tokens with penalties, one token a step; then
/// again with drafts of up to 4 tokens of that text, each verify position
/// with the bias of the draft before it counted (`per_row`) or with the
/// first position's for all. Returns (plain, drafted).
fn penalised(e: &mut CpuExecutor, n: usize, per_row: bool) -> (Vec<u32>, Vec<u32>) {
    let table: Vec<u32> = (0..16).collect();
    let p = SamplingParams::greedy();
    let (pres, freq) = (1.5, 1.0);
    let mut out = StepOutputs::default();
    let mut ids = PROMPT.to_vec();
    let mut start = 0;
    while ids.len() < PROMPT.len() + n {
        let bias = penalties(&ids[PROMPT.len()..], pres, freq);
        let mut b = one_seq(&ids[start..], start, OutputKind::Sample(p), &table);
        b[0].bias = &bias;
        e.step(&b, &mut out).unwrap();
        start = ids.len();
        ids.push(out.token_of(0).unwrap());
    }
    let reference = ids.split_off(PROMPT.len());
    // With drafts: the prompt, then steps that verify up to 4 tokens.
    let mut ids = PROMPT.to_vec();
    let mut b = one_seq(&PROMPT, 0, OutputKind::Sample(p), &table);
    let bias = penalties(&[], pres, freq);
    b[0].bias = &bias;
    e.step(&b, &mut out).unwrap();
    ids.push(out.token_of(0).unwrap());
    while ids.len() < PROMPT.len() + n {
        let done = ids.len() - PROMPT.len();
        let guess = &reference[done..(done + 4).min(n - 1)];
        let mut tokens = vec![*ids.last().unwrap()];
        tokens.extend_from_slice(guess);
        let generated = ids[PROMPT.len()..].to_vec();
        let bias = penalties(&generated, pres, freq);
        let rows: Vec<Vec<(u32, f32)>> = (1..=guess.len())
            .map(|r| penalties(&[&generated[..], &guess[..r]].concat(), pres, freq))
            .collect();
        let output = if guess.is_empty() {
            OutputKind::Sample(p)
        } else {
            OutputKind::Verify {
                params: p,
                draft: guess.len(),
            }
        };
        let mut b = one_seq(&tokens, ids.len() - 1, output, &table);
        b[0].bias = &bias;
        if per_row {
            b[0].draft_bias = &rows;
        }
        e.step(&b, &mut out).unwrap();
        ids.extend(out.seqs[0].tokens().map(|s| s.token));
    }
    ids.truncate(PROMPT.len() + n);
    (reference, ids.split_off(PROMPT.len()))
}

#[test]
fn verified_drafts_under_penalties_give_the_tokens_of_plain_decoding() {
    let mut e = exec(KvDtype::F16);
    let (reference, drafted) = penalised(&mut e, 40, true);
    assert_eq!(drafted, reference, "per-position biases keep the text");
    // The penalties matter within a draft: one bias for every position
    // changes the text (so the test above can fail).
    let (reference, drafted) = penalised(&mut e, 40, false);
    assert_ne!(drafted, reference);
}

#[test]
fn bad_drafts_are_refused() {
    let mut e = exec(KvDtype::F16);
    let table: Vec<u32> = (0..16).collect();
    let mut out = StepOutputs::default();
    let p = SamplingParams::greedy();
    for (tokens, draft) in [(&[1u32, 2, 3][..], 3), (&[1, 2, 3][..], 0)] {
        let batch = one_seq(tokens, 0, OutputKind::Verify { params: p, draft }, &table);
        let e = e.step(&batch, &mut out).unwrap_err();
        assert!(e.to_string().contains("draft"), "{e}");
    }
    // A bias row per draft position, or none: not one of each.
    let rows = vec![Vec::new()];
    let mut batch = one_seq(
        &[1, 2, 3],
        0,
        OutputKind::Verify {
            params: p,
            draft: 2,
        },
        &table,
    );
    batch[0].draft_bias = &rows;
    let e = e.step(&batch, &mut out).unwrap_err();
    assert!(e.to_string().contains("rows of bias"), "{e}");
}

/// What a self-draft that exits early would be worth: how often the next
/// token predicted from the first `l` layers (then the final norm and head)
/// equals the whole model's greedy token, over 100 tokens of the model's own
/// text. Printed per depth; only the whole depth must agree everywhere.
#[test]
fn early_exit_agreement_with_the_whole_model() {
    let mut e = exec(KvDtype::F16);
    let table: Vec<u32> = (0..16).collect();
    let reference = plain_decode(&mut e, &PROMPT, SamplingParams::greedy(), 100, &table);
    let ids: Vec<u32> = PROMPT.iter().chain(&reference).copied().collect();
    let n_layer = e.config().n_layer;
    let mut picks = |layers: Vec<usize>| -> Vec<usize> {
        e.set_layers(Some(layers));
        let mut out = StepOutputs::default();
        let output = OutputKind::Verify {
            params: SamplingParams::greedy(),
            draft: ids.len() - 1,
        };
        let batch = one_seq(&ids, 0, output, &table);
        e.step(&batch, &mut out).unwrap();
        out.logits
            .chunks_exact(out.vocab)
            .skip(PROMPT.len() - 1)
            .take(reference.len())
            .map(|row| {
                row.iter()
                    .enumerate()
                    .fold(0, |b, (i, &x)| if x > row[b] { i } else { b })
            })
            .collect()
    };
    let full = picks((0..n_layer).collect());
    assert_eq!(
        full.iter().map(|&t| t as u32).collect::<Vec<_>>(),
        reference,
        "the whole model in one pass predicts its own greedy text"
    );
    let mut rates = Vec::new();
    for l in [n_layer / 4, n_layer / 2, 3 * n_layer / 4, n_layer - 2] {
        let early = picks((0..l).collect());
        let agree = early.iter().zip(&full).filter(|(a, b)| a == b).count();
        let rate = agree as f64 / full.len() as f64;
        eprintln!(
            "exit after {l} of {n_layer} layers: {agree} of {} tokens agree ({rate:.2})",
            full.len()
        );
        rates.push(rate);
    }
    // Skipping layers instead (the first and last four always run): every
    // third, every other, two of three of the middle ones, and one middle
    // layer alone.
    let edge = 4.min(n_layer / 4);
    for (name, skip) in [
        ("every 3rd middle layer", 3usize),
        ("every 2nd middle layer", 2),
    ] {
        let kept: Vec<usize> = (0..n_layer)
            .filter(|&l| l < edge || l >= n_layer - edge || (l - edge) % skip != skip - 1)
            .collect();
        let got = picks(kept.clone());
        let agree = got.iter().zip(&full).filter(|(a, b)| a == b).count();
        eprintln!(
            "skip {name}: {} of {n_layer} layers run, {agree} of {} tokens agree",
            kept.len(),
            full.len()
        );
    }
    for one in [n_layer / 2, n_layer - 1] {
        let kept: Vec<usize> = (0..n_layer).filter(|&l| l != one).collect();
        let got = picks(kept);
        let agree = got.iter().zip(&full).filter(|(a, b)| a == b).count();
        eprintln!(
            "skip layer {one} alone: {agree} of {} tokens agree",
            full.len()
        );
    }
    assert!(
        rates[0] < 1.0,
        "a quarter of the model predicts like all of it"
    );
}

/// A draft model's cut head (`CpuConfig::head_rows`): the logits of the
/// first ids are the whole head's, to the bit, and its greedy token is
/// the best among them (a guess; the target verifies it).
#[test]
fn a_cut_head_computes_the_first_logits_of_the_whole_head() {
    let table: Vec<u32> = (0..16).collect();
    let mut whole = exec(KvDtype::F16);
    let cfg = CpuConfig {
        kv_dtype: KvDtype::F16,
        threads: 2,
        num_blocks: 64,
        max_batch_tokens: 128,
        head_rows: 1000,
        ..Default::default()
    };
    let mut cut = CpuExecutor::load(&flotilla_hub::test_model_path(), &cfg).unwrap();
    let (mut a, mut b) = (StepOutputs::default(), StepOutputs::default());
    whole
        .step(&one_seq(&PROMPT, 0, OutputKind::Logits, &table), &mut a)
        .unwrap();
    cut.step(&one_seq(&PROMPT, 0, OutputKind::Logits, &table), &mut b)
        .unwrap();
    assert_eq!(b.vocab, 1000);
    assert!(a.vocab > 40_000, "{}", a.vocab);
    let (ra, rb) = (a.seqs[0].logits_row.unwrap(), b.seqs[0].logits_row.unwrap());
    let first = &a.logits[ra * a.vocab..ra * a.vocab + 1000];
    assert_eq!(first, &b.logits[rb * 1000..(rb + 1) * 1000]);
    // Its greedy pick: the argmax of those first ids.
    let p = SamplingParams::greedy();
    cut.step(&one_seq(&PROMPT, 0, OutputKind::Sample(p), &table), &mut b)
        .unwrap();
    let best = first
        .iter()
        .enumerate()
        .max_by(|x, y| x.1.total_cmp(y.1))
        .unwrap()
        .0;
    assert_eq!(b.seqs[0].sampled.as_ref().unwrap().token as usize, best);
    // A cut that is not a whole number of the kernels' row groups is
    // rounded up to one.
    let cfg = CpuConfig {
        head_rows: 1001,
        ..cfg
    };
    let mut odd = CpuExecutor::load(&flotilla_hub::test_model_path(), &cfg).unwrap();
    odd.step(&one_seq(&PROMPT, 0, OutputKind::Logits, &table), &mut b)
        .unwrap();
    assert_eq!(b.vocab, 1008);
}
