//! Helpers shared by the model tests.

#![allow(dead_code)]

use flotilla_model::{CpuExecutor, Executor, OutputKind, SeqInput, StepOutputs};

/// A little-endian f32 fixture file (golden logits).
pub fn read_f32(path: &std::path::Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// Index of the largest logit (the first on ties).
pub fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold(0, |b, (i, &x)| if x > v[b] { i } else { b })
}

/// The logits after `ids`, running `ids[start..]` as one chunk (positions
/// before `start` are already in the cache) over the block table `table`.
pub fn step_logits(e: &mut CpuExecutor, ids: &[u32], start: usize, table: &[u32]) -> Vec<f32> {
    let mut out = StepOutputs::default();
    let batch = [SeqInput {
        tokens: &ids[start..],
        start_pos: start,
        block_table: table,
        output: OutputKind::Logits,
        bias: &[],
        draft_bias: &[],
        allow: None,
    }];
    e.step(&batch, &mut out).unwrap();
    out.logits_of(0).unwrap().to_vec()
}

/// Logits after each of `ends` (ascending positions), running `ids` as
/// consecutive prefill chunks that end there, over the block table `table`.
pub fn logits_at(e: &mut CpuExecutor, ids: &[u32], ends: &[usize], table: &[u32]) -> Vec<Vec<f32>> {
    let mut start = 0;
    let mut rows = Vec::with_capacity(ends.len());
    for &p in ends {
        rows.push(step_logits(e, &ids[..=p], start, table));
        start = p + 1;
    }
    rows
}
