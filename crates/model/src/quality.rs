//! How much a cheaper setting (an int8 KV cache) changes the model's
//! predictions: teacher-forced next-token distributions over a text, and
//! the KL divergence of one run's from another's, as llama.cpp's
//! `llama-perplexity --kl-divergence` reports them.

use flotilla_exec::executor::{ExecError, Executor, OutputKind, SeqInput, StepOutputs};

/// Log-probabilities of the next token after every prefix of `tokens`
/// (row `i` follows `tokens[..=i]`), the text's KV in the executor's cache
/// in its own dtype: the whole text is prefilled once, then every position
/// is run again as a one-token sequence over the same blocks (rewriting its
/// own slot with the same values), many per step. Uses blocks `0..` of the
/// cache.
pub fn teacher_forced_logprobs(
    e: &mut dyn Executor,
    tokens: &[u32],
) -> Result<Vec<Vec<f32>>, ExecError> {
    let kv = e.kv_spec();
    let n = tokens.len();
    let table: Vec<u32> = (0..n.div_ceil(kv.block_size) as u32).collect();
    let budget = e.max_batch_tokens().max(1);
    let mut out = StepOutputs::default();
    let mut s = 0;
    while s < n {
        let t = (s + budget).min(n);
        let b = [SeqInput {
            tokens: &tokens[s..t],
            start_pos: s,
            block_table: &table,
            output: OutputKind::None,
            bias: &[],
            draft_bias: &[],
            allow: None,
        }];
        e.step(&b, &mut out)?;
        s = t;
    }
    let mut rows = Vec::with_capacity(n);
    let per = budget.min(64);
    for first in (0..n).step_by(per) {
        let chunk = first..(first + per).min(n);
        let b: Vec<SeqInput<'_>> = chunk
            .clone()
            .map(|i| SeqInput {
                tokens: &tokens[i..=i],
                start_pos: i,
                block_table: &table,
                output: OutputKind::Logits,
                bias: &[],
                draft_bias: &[],
                allow: None,
            })
            .collect();
        e.step(&b, &mut out)?;
        for j in 0..chunk.len() {
            let l = out.logits_of(j).expect("asked for logits");
            rows.push(log_softmax(l));
        }
    }
    Ok(rows)
}

/// Log-probabilities of `l`'s logits (the sum taken in f64).
pub fn log_softmax(l: &[f32]) -> Vec<f32> {
    let m = l.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let z: f64 = l.iter().map(|&v| ((v - m) as f64).exp()).sum();
    let lz = m as f64 + z.ln();
    l.iter().map(|&v| (v as f64 - lz) as f32).collect()
}

/// How a run's distributions differ from a reference run's, position by
/// position.
#[derive(Clone, Debug, PartialEq)]
pub struct Divergence {
    /// Positions compared.
    pub positions: usize,
    /// Mean KL(reference || run), nats.
    pub mean_kl: f64,
    /// 99th percentile of the per-position KL.
    pub p99_kl: f64,
    /// Largest per-position KL.
    pub max_kl: f64,
    /// Share of positions whose most likely token is the reference's.
    pub top1_agreement: f64,
    /// Of the positions whose top-1 differs, the largest gap between the
    /// reference's top two log-probabilities (a near-tie has a small gap).
    pub max_flip_gap: f64,
}

/// The divergence of `run` from `reference` over the rows whose index
/// `keep` accepts (both from [`teacher_forced_logprobs`] over the same
/// tokens).
pub fn divergence(
    reference: &[Vec<f32>],
    run: &[Vec<f32>],
    keep: impl Fn(usize) -> bool,
) -> Divergence {
    assert_eq!(reference.len(), run.len());
    let mut kls = Vec::new();
    let mut agree = 0usize;
    let mut max_flip_gap = 0f64;
    let rows = reference.iter().zip(run).enumerate();
    for (_, (p, q)) in rows.filter(|(i, _)| keep(*i)) {
        let kl: f64 = p
            .iter()
            .zip(q)
            .map(|(&a, &b)| (a as f64).exp() * (a as f64 - b as f64))
            .sum();
        kls.push(kl.max(0.0));
        let (ap, aq) = (argmax(p), argmax(q));
        if ap == aq {
            agree += 1;
        } else {
            let mut sorted = p.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            max_flip_gap = max_flip_gap.max((sorted[0] - sorted[1]) as f64);
        }
    }
    let n = kls.len();
    let mean_kl = kls.iter().sum::<f64>() / n.max(1) as f64;
    let mut sorted = kls.clone();
    sorted.sort_by(f64::total_cmp);
    let p99_kl = sorted
        .get(((n as f64 * 0.99).ceil() as usize).saturating_sub(1))
        .copied()
        .unwrap_or(0.0);
    Divergence {
        positions: n,
        mean_kl,
        p99_kl,
        max_kl: sorted.last().copied().unwrap_or(0.0),
        top1_agreement: agree as f64 / n.max(1) as f64,
        max_flip_gap,
    }
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &x)| {
            if x > bv { (i, x) } else { (bi, bv) }
        })
        .0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn divergence_of_a_run_from_itself_is_zero_and_grows_with_a_change() {
        let a = vec![
            log_softmax(&[1.0, 2.0, 3.0]),
            log_softmax(&[0.5, 0.1, -1.0]),
        ];
        let d = divergence(&a, &a, |_| true);
        assert_eq!((d.positions, d.top1_agreement), (2, 1.0));
        assert!(d.mean_kl.abs() < 1e-9 && d.max_flip_gap == 0.0, "{d:?}");
        let b = vec![log_softmax(&[1.0, 3.5, 3.0]), a[1].clone()];
        let d = divergence(&a, &b, |_| true);
        assert_eq!(d.top1_agreement, 0.5);
        assert!(d.mean_kl > 0.05 && d.max_kl > d.mean_kl, "{d:?}");
        assert!((d.max_flip_gap - 1.0).abs() < 1e-5, "{d:?}");
        assert!(divergence(&a, &b, |i| i >= 1).mean_kl.abs() < 1e-9);
    }
}
