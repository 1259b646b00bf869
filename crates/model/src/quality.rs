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

/// llama.cpp's next-token log-probabilities as `llama-perplexity
/// --kl-divergence-base FILE` writes them: the tokens it ran (chunks of
/// `n_ctx`), and for each chunk the rows of its second half (positions
/// `n_ctx / 2 .. n_ctx - 1`, each predicting the next token), every
/// log-probability stored in 16 bits between the row's largest and 16
/// nats below it (those at or below the floor read as the floor).
#[derive(Clone, Debug, PartialEq)]
pub struct PeerLogprobs {
    /// Vocabulary size.
    pub n_vocab: usize,
    /// Tokens per chunk.
    pub n_ctx: usize,
    /// The tokens, `n_ctx` per chunk.
    pub chunks: Vec<Vec<u32>>,
    /// Per chunk, `n_ctx - 1 - n_ctx / 2` rows of `n_vocab` log-probabilities.
    pub rows: Vec<Vec<Vec<f32>>>,
    /// Per chunk and row, the floor (entries at it carry no information).
    pub floors: Vec<Vec<f32>>,
}

impl PeerLogprobs {
    /// Parses a base file (`_logits_`, then n_ctx, n_vocab and the chunk
    /// count as 32-bit words, the tokens, the rows), which must be of
    /// chunks of `n_ctx` tokens.
    pub fn parse(bytes: &[u8], n_ctx: usize) -> Result<PeerLogprobs, String> {
        let word = |at: usize| -> Result<u32, String> {
            bytes
                .get(at..at + 4)
                .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
                .ok_or_else(|| format!("cut short at byte {at}"))
        };
        if bytes.get(..8) != Some(b"_logits_".as_slice()) {
            return Err("not a llama-perplexity base file (no _logits_ magic)".into());
        }
        let file_ctx = word(8)? as usize;
        if file_ctx != n_ctx {
            return Err(format!(
                "chunks of {file_ctx} tokens, not {n_ctx} (another --chunk?)"
            ));
        }
        let (n_vocab, n_chunk) = (word(12)? as usize, word(16)? as usize);
        if n_vocab == 0 || n_ctx < 4 {
            return Err(format!("n_vocab {n_vocab}, n_ctx {n_ctx}"));
        }
        let nv = 2 * n_vocab.div_ceil(2) + 4;
        let per_chunk = n_ctx - 1 - n_ctx / 2;
        let want = 20 + 4 * n_chunk * n_ctx + 2 * n_chunk * per_chunk * nv;
        if bytes.len() != want {
            return Err(format!(
                "{} bytes, where {n_chunk} chunks of {n_ctx} tokens over {n_vocab} would be {want}",
                bytes.len()
            ));
        }
        let mut at = 20;
        let mut chunks = Vec::with_capacity(n_chunk);
        for _ in 0..n_chunk {
            chunks.push(
                (0..n_ctx)
                    .map(|i| word(at + 4 * i))
                    .collect::<Result<Vec<u32>, _>>()?,
            );
            at += 4 * n_ctx;
        }
        let (mut rows, mut floors) = (Vec::new(), Vec::new());
        for _ in 0..n_chunk {
            let (mut rs, mut fs) = (Vec::with_capacity(per_chunk), Vec::with_capacity(per_chunk));
            for _ in 0..per_chunk {
                let f = |k: usize| {
                    f32::from_le_bytes(bytes[at + 4 * k..at + 4 * k + 4].try_into().unwrap())
                };
                let (scale, min) = (f(0), f(1));
                let u = &bytes[at + 8..at + 8 + 2 * n_vocab];
                rs.push(
                    u.chunks_exact(2)
                        .map(|b| scale * u16::from_le_bytes([b[0], b[1]]) as f32 + min)
                        .collect(),
                );
                fs.push(min);
                at += 2 * nv;
            }
            rows.push(rs);
            floors.push(fs);
        }
        Ok(PeerLogprobs {
            n_vocab,
            n_ctx,
            chunks,
            rows,
            floors,
        })
    }
}

/// [`divergence`] of `run` from a peer's rows, each with its floor: the KL
/// sums over the tokens whose peer log-probability is above -16 nats and
/// above the row's floor (llama-perplexity's own rule), and a top-1 tie at
/// the floor cannot happen (the peer's top token is its largest).
pub fn divergence_from_peer(
    reference: &[Vec<f32>],
    floors: &[f32],
    run: &[Vec<f32>],
) -> Divergence {
    assert_eq!(reference.len(), run.len());
    assert_eq!(reference.len(), floors.len());
    let mut kls = Vec::new();
    let mut agree = 0usize;
    let mut max_flip_gap = 0f64;
    for ((p, q), &floor) in reference.iter().zip(run).zip(floors) {
        let kl: f64 = p
            .iter()
            .zip(q)
            .filter(|&(&a, _)| a > -16.0 && a > floor)
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
    let mut sorted = kls.clone();
    sorted.sort_by(f64::total_cmp);
    Divergence {
        positions: n,
        mean_kl: kls.iter().sum::<f64>() / n.max(1) as f64,
        p99_kl: sorted
            .get(((n as f64 * 0.99).ceil() as usize).saturating_sub(1))
            .copied()
            .unwrap_or(0.0),
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

    /// A file written as llama-perplexity writes one (its layout, its
    /// 16-bit rows) reads back to the tokens and, within a 16-bit step, to
    /// the log-probabilities; a run equal to them diverges by ~0, a changed
    /// one does not; a file of another chunk size is refused.
    #[test]
    fn a_peer_base_file_reads_back_and_compares() {
        let (n_vocab, n_ctx, n_chunk) = (5usize, 8usize, 2usize);
        let nv = 2 * n_vocab.div_ceil(2) + 4;
        let mut b = b"_logits_".to_vec();
        b.extend_from_slice(&(n_ctx as u32).to_le_bytes());
        b.extend_from_slice(&(n_vocab as u32).to_le_bytes());
        b.extend_from_slice(&(n_chunk as u32).to_le_bytes());
        let toks: Vec<u32> = (0..(n_ctx * n_chunk) as u32).map(|i| i % 5).collect();
        for t in &toks {
            b.extend_from_slice(&t.to_le_bytes());
        }
        let mut want = Vec::new();
        for c in 0..n_chunk {
            for r in 0..n_ctx - 1 - n_ctx / 2 {
                let logits: Vec<f32> = (0..n_vocab)
                    .map(|i| ((i + r + c) % 5) as f32 * 1.5)
                    .collect();
                let lp = log_softmax(&logits);
                // As llama.cpp stores a row (max 6.0, min 0.0: within 16 nats).
                let (mx, mn) = (6.0f32, 0.0f32);
                let lse = lp.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
                let scale = (mx - mn) / 65535.0;
                let min_lp = mn - mx + lse;
                let mut row = vec![0u16; nv];
                row[..2].copy_from_slice(&[scale.to_bits() as u16, (scale.to_bits() >> 16) as u16]);
                row[2..4]
                    .copy_from_slice(&[min_lp.to_bits() as u16, (min_lp.to_bits() >> 16) as u16]);
                for (i, &l) in logits.iter().enumerate() {
                    row[4 + i] = ((l - mn) / scale).round() as u16;
                }
                for v in row {
                    b.extend_from_slice(&v.to_le_bytes());
                }
                want.push(lp);
            }
        }
        let p = PeerLogprobs::parse(&b, n_ctx).unwrap();
        assert_eq!(
            (p.n_vocab, p.n_ctx, p.chunks.len()),
            (n_vocab, n_ctx, n_chunk)
        );
        assert_eq!(p.chunks.concat(), toks);
        let got: Vec<Vec<f32>> = p.rows.concat();
        for (g, w) in got.iter().zip(&want) {
            for (a, b) in g.iter().zip(w) {
                assert!((a - b).abs() < 1e-3, "{g:?} vs {w:?}");
            }
        }
        let floors = p.floors.concat();
        let d = divergence_from_peer(&got, &floors, &want);
        assert!(d.mean_kl < 1e-6 && d.top1_agreement == 1.0, "{d:?}");
        let mut moved = want.clone();
        moved[0] = log_softmax(&[9.0, 0.0, 0.0, 0.0, 0.0]);
        let d = divergence_from_peer(&got, &floors, &moved);
        assert!(d.max_kl > 1.0 && d.top1_agreement < 1.0, "{d:?}");
        assert!(
            PeerLogprobs::parse(&b, 16)
                .unwrap_err()
                .contains("another --chunk")
        );
        assert!(PeerLogprobs::parse(&b[..6], n_ctx).is_err());
        assert!(PeerLogprobs::parse(&b[..b.len() - 2], n_ctx).is_err());
    }

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
