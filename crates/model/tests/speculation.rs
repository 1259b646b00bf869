//! Draft verification on the real model: a step that verifies draft tokens
//! samples each position exactly as plain decoding does, greedy or not, so
//! accepting the matching prefix changes no token.

use flotilla_model::{
    CpuConfig, CpuExecutor, Executor, KvDtype, OutputKind, SamplingParams, SeqInput, StepOutputs,
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

/// `n` tokens after the prompt, one decode step each.
fn plain(e: &mut CpuExecutor, p: SamplingParams, n: usize, table: &[u32]) -> Vec<u32> {
    let mut out = StepOutputs::default();
    let mut ids = PROMPT.to_vec();
    let mut start = 0;
    while ids.len() < PROMPT.len() + n {
        let batch = [SeqInput {
            tokens: &ids[start..],
            start_pos: start,
            block_table: table,
            output: OutputKind::Sample(p),
            bias: &[],
            allow: None,
        }];
        e.step(&batch, &mut out).unwrap();
        start = ids.len();
        ids.push(out.token_of(0).unwrap());
    }
    ids[PROMPT.len()..].to_vec()
}

/// The same tokens with a draft of up to `k` tokens each step, taken from
/// `reference` with every `wrong`-th guess replaced by a wrong token; the
/// output must equal `reference` token for token. Returns (drafted, accepted).
fn speculative(
    e: &mut CpuExecutor,
    p: SamplingParams,
    reference: &[u32],
    k: usize,
    wrong: usize,
    table: &[u32],
) -> (usize, usize) {
    let mut out = StepOutputs::default();
    // Prefill alone first: a draft follows a decode.
    let first = {
        let batch = [SeqInput {
            tokens: &PROMPT,
            start_pos: 0,
            block_table: table,
            output: OutputKind::Sample(p),
            bias: &[],
            allow: None,
        }];
        e.step(&batch, &mut out).unwrap();
        out.token_of(0).unwrap()
    };
    let mut ids = PROMPT.to_vec();
    ids.push(first);
    let (mut drafted, mut accepted, mut guesses) = (0, 0, 0);
    while ids.len() < PROMPT.len() + reference.len() {
        let done = ids.len() - PROMPT.len();
        let room = k.min(reference.len() - done - 1);
        let mut tokens = vec![*ids.last().unwrap()];
        for g in &reference[done..done + room] {
            guesses += 1;
            tokens.push(if guesses % wrong == 0 {
                (g + 1) % 49152
            } else {
                *g
            });
        }
        let draft = tokens.len() - 1;
        let output = if draft == 0 {
            OutputKind::Sample(p)
        } else {
            OutputKind::Verify { params: p, draft }
        };
        let batch = [SeqInput {
            tokens: &tokens,
            start_pos: ids.len() - 1,
            block_table: table,
            output,
            bias: &[],
            allow: None,
        }];
        e.step(&batch, &mut out).unwrap();
        let got: Vec<u32> = out.seqs[0].tokens().map(|s| s.token).collect();
        assert!(!got.is_empty() && got.len() <= draft + 1);
        assert_eq!(
            &got[..got.len() - 1],
            &tokens[1..got.len()],
            "accepted a token not drafted"
        );
        drafted += draft;
        accepted += got.len() - 1;
        ids.extend(got);
    }
    ids.truncate(PROMPT.len() + reference.len());
    assert_eq!(
        &ids[PROMPT.len()..],
        reference,
        "speculation changed the output"
    );
    (drafted, accepted)
}

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
            let reference = plain(&mut e, p, 40, &table);
            for (k, wrong) in [(4, 3), (7, 5), (2, 1000)] {
                let (drafted, accepted) = speculative(&mut e, p, &reference, k, wrong, &table);
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

#[test]
fn bad_drafts_are_refused() {
    let mut e = exec(KvDtype::F16);
    let table: Vec<u32> = (0..16).collect();
    let mut out = StepOutputs::default();
    let p = SamplingParams::greedy();
    for (tokens, draft) in [(&[1u32, 2, 3][..], 3), (&[1, 2, 3][..], 0)] {
        let batch = [SeqInput {
            tokens,
            start_pos: 0,
            block_table: &table,
            output: OutputKind::Verify { params: p, draft },
            bias: &[],
            allow: None,
        }];
        let e = e.step(&batch, &mut out).unwrap_err();
        assert!(e.to_string().contains("draft"), "{e}");
    }
}

/// What a self-draft that exits early would be worth: how often the next
/// token predicted from the first `l` layers (then the final norm and head)
/// equals the whole model's greedy token, over 100 tokens of the model's own
/// text. Printed per depth; only the whole depth must agree everywhere.
#[test]
fn early_exit_agreement_with_the_whole_model() {
    let mut e = exec(KvDtype::F16);
    let table: Vec<u32> = (0..16).collect();
    let reference = plain(&mut e, SamplingParams::greedy(), 100, &table);
    let ids: Vec<u32> = PROMPT.iter().chain(&reference).copied().collect();
    let n_layer = e.config().n_layer;
    let mut picks = |layers: usize| -> Vec<usize> {
        e.set_exit_layer(Some(layers));
        let mut out = StepOutputs::default();
        let batch = [SeqInput {
            tokens: &ids,
            start_pos: 0,
            block_table: &table,
            output: OutputKind::Verify {
                params: SamplingParams::greedy(),
                draft: ids.len() - 1,
            },
            bias: &[],
            allow: None,
        }];
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
    let full = picks(n_layer);
    assert_eq!(
        full.iter().map(|&t| t as u32).collect::<Vec<_>>(),
        reference,
        "the whole model in one pass predicts its own greedy text"
    );
    let mut rates = Vec::new();
    for l in [n_layer / 4, n_layer / 2, 3 * n_layer / 4, n_layer - 2] {
        let early = picks(l);
        let agree = early.iter().zip(&full).filter(|(a, b)| a == b).count();
        let rate = agree as f64 / full.len() as f64;
        eprintln!(
            "exit after {l} of {n_layer} layers: {agree} of {} tokens agree ({rate:.2})",
            full.len()
        );
        rates.push(rate);
    }
    assert!(
        rates[0] < 1.0,
        "a quarter of the model predicts like all of it"
    );
}
