//! Test support: deterministic test data.

/// A small deterministic generator for test data: uniform in [-1, 1).
pub fn rnd(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

use crate::sampling::SamplingParams;
use flotilla_exec::executor::{Executor, OutputKind, SeqInput, StepOutputs};

/// A batch of one sequence's input, with nothing but `output` to ask.
pub fn one_seq<'a>(
    tokens: &'a [u32],
    start_pos: usize,
    output: OutputKind,
    table: &'a [u32],
) -> [SeqInput<'a>; 1] {
    [SeqInput {
        tokens,
        start_pos,
        block_table: table,
        output,
        bias: &[],
        draft_bias: &[],
        allow: None,
    }]
}

/// `n` tokens after `prompt`, one decode step each (the prompt as one chunk).
pub fn plain_decode(
    e: &mut dyn Executor,
    prompt: &[u32],
    p: SamplingParams,
    n: usize,
    table: &[u32],
) -> Vec<u32> {
    let mut out = StepOutputs::default();
    let mut ids = prompt.to_vec();
    let mut start = 0;
    while ids.len() < prompt.len() + n {
        e.step(
            &one_seq(&ids[start..], start, OutputKind::Sample(p), table),
            &mut out,
        )
        .unwrap();
        start = ids.len();
        ids.push(out.token_of(0).unwrap());
    }
    ids.split_off(prompt.len())
}

/// Decodes `reference.len()` tokens after `prompt` again, each step
/// verifying a draft of up to `k` tokens taken from `reference` with every
/// `wrong`-th guess replaced by a wrong token, and asserts that the output
/// is `reference` token for token and that only drafted tokens were
/// accepted. Returns (drafted, accepted).
pub fn decode_with_drafts(
    e: &mut dyn Executor,
    prompt: &[u32],
    p: SamplingParams,
    reference: &[u32],
    (k, wrong): (usize, usize),
    table: &[u32],
) -> (usize, usize) {
    let vocab = e.model_spec().vocab as u32;
    let mut out = StepOutputs::default();
    // The prompt alone first: a draft follows a decode.
    e.step(&one_seq(prompt, 0, OutputKind::Sample(p), table), &mut out)
        .unwrap();
    let mut ids = prompt.to_vec();
    ids.push(out.token_of(0).unwrap());
    let (mut drafted, mut accepted, mut guesses) = (0, 0, 0);
    while ids.len() < prompt.len() + reference.len() {
        let done = ids.len() - prompt.len();
        let room = k.min(reference.len() - done - 1);
        let mut tokens = vec![*ids.last().unwrap()];
        for g in &reference[done..done + room] {
            guesses += 1;
            tokens.push(if guesses % wrong == 0 {
                (g + 1) % vocab
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
        e.step(&one_seq(&tokens, ids.len() - 1, output, table), &mut out)
            .unwrap();
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
    ids.truncate(prompt.len() + reference.len());
    assert_eq!(
        &ids[prompt.len()..],
        reference,
        "speculation changed the output"
    );
    (drafted, accepted)
}
