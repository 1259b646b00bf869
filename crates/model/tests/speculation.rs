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
    let mut picks = |layers: usize| -> Vec<usize> {
        e.set_exit_layer(Some(layers));
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
