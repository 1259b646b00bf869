//! Per-sequence sampling: greedy, temperature, top-k, top-p, seeded, with
//! log-probabilities of the chosen token and the top alternatives.
//!
//! Randomness is a pure function of (seed, position of the token drawn): no
//! sampler state lives between steps, so a sequence that is preempted and
//! recomputed, or moved to another node, draws exactly the same tokens.

pub use flotilla_exec::{MAX_TOP_LOGPROBS, Sampled, SamplingParams};

/// Reusable buffers so that sampling allocates nothing per token.
#[derive(Default)]
pub struct SamplerScratch {
    idx: Vec<u32>,
    prob: Vec<f32>,
    /// A copy of the row with the sequence's bias added.
    biased: Vec<f32>,
}

impl SamplerScratch {
    /// Buffers sized for a vocabulary, so no step ever grows them.
    pub fn with_capacity(vocab: usize) -> Self {
        SamplerScratch {
            idx: Vec::with_capacity(vocab),
            prob: Vec::with_capacity(vocab),
            biased: Vec::with_capacity(vocab),
        }
    }
}

/// Tokens whose scaled logit is this far below the maximum carry less than
/// e^-30 of its probability each; they are left out of top-p sorting.
const TAIL_CUTOFF: f32 = 30.0;

/// A uniform draw in [0, 1) from (seed, position): SplitMix64 finalisation.
pub fn uniform(seed: u64, position: u64) -> f64 {
    use flotilla_exec::rng::{GAMMA, mix64, unit_f64};
    unit_f64(mix64(
        seed ^ position
            .wrapping_mul(GAMMA)
            .wrapping_add(0xD1B5_4A32_D192_ED03),
    ))
}

/// Picks a token from `logits` plus `bias` (`(token, amount)` pairs, the
/// request's `logit_bias` and penalties; ids past the vocabulary are
/// skipped), among the tokens `allow` lets through (a bitmask from the
/// request's constraint; `None`: all), for the token at `position` of the
/// sequence. Log-probabilities are those of the distribution the token was
/// drawn from (biased, masked). A mask that allows nothing leaves the
/// argmax of the unmasked row.
pub fn sample(
    logits: &[f32],
    p: &SamplingParams,
    bias: &[(u32, f32)],
    allow: Option<&[u32]>,
    position: u64,
    scratch: &mut SamplerScratch,
) -> Sampled {
    if bias.is_empty() && allow.is_none() {
        return sample_row(logits, p, position, scratch);
    }
    let greedy = (p.temperature == 0.0 || p.top_k == 1) && !p.logprobs && p.top_logprobs == 0;
    if greedy && let Some(words) = allow {
        // The common constrained draw: the best allowed token, read off the
        // mask's set bits, with no copy of the row.
        if let Some(token) = masked_argmax(logits, bias, words) {
            return Sampled {
                token,
                logprob: f32::NAN,
                top: Vec::new(),
            };
        }
    }
    let mut biased = std::mem::take(&mut scratch.biased);
    biased.clear();
    biased.extend_from_slice(logits);
    for &(t, b) in bias {
        if let Some(v) = biased.get_mut(t as usize) {
            *v += b;
        }
    }
    if let Some(words) = allow {
        // Word by word: most words of a mask are all clear.
        let mut any = false;
        for (i, chunk) in biased.chunks_mut(32).enumerate() {
            let w = words.get(i).copied().unwrap_or(0);
            if w == u32::MAX {
                any = true;
            } else if w == 0 {
                chunk.fill(f32::NEG_INFINITY);
            } else {
                any = true;
                for (b, v) in chunk.iter_mut().enumerate() {
                    if w >> b & 1 == 0 {
                        *v = f32::NEG_INFINITY;
                    }
                }
            }
        }
        if !any {
            biased.clear();
            biased.extend_from_slice(logits);
        }
    }
    let got = sample_row(&biased, p, position, scratch);
    scratch.biased = biased;
    got
}

fn sample_row(
    logits: &[f32],
    p: &SamplingParams,
    position: u64,
    scratch: &mut SamplerScratch,
) -> Sampled {
    let token = if p.temperature == 0.0 || p.top_k == 1 {
        argmax(logits)
    } else {
        sample_random(logits, p, position, scratch)
    };
    let (logprob, top) = if p.logprobs || p.top_logprobs > 0 {
        let lse = log_sum_exp(logits);
        let top = top_n(logits, p.top_logprobs as usize, scratch)
            .iter()
            .map(|&i| (i, logits[i as usize] - lse))
            .collect();
        (logits[token as usize] - lse, top)
    } else {
        (f32::NAN, Vec::new())
    };
    Sampled {
        token,
        logprob,
        top,
    }
}

/// The best token `words` allows by `logits` plus `bias` (the first one on
/// ties, NaN never), or `None` when it allows none with a value.
fn masked_argmax(logits: &[f32], bias: &[(u32, f32)], words: &[u32]) -> Option<u32> {
    let mut best: Option<(u32, f32)> = None;
    for (i, &w) in words.iter().enumerate() {
        let mut w = w;
        while w != 0 {
            let t = i as u32 * 32 + w.trailing_zeros();
            w &= w - 1;
            let Some(&l) = logits.get(t as usize) else {
                return best.map(|b| b.0);
            };
            // Biases are few (a sorted list): look the token up.
            let v = l + bias
                .binary_search_by_key(&t, |&(id, _)| id)
                .map_or(0.0, |k| bias[k].1);
            if v > best.map_or(f32::NEG_INFINITY, |b| b.1) {
                best = Some((t, v));
            }
        }
    }
    best.map(|b| b.0)
}

/// Index of the largest logit (the first one on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    let mut bv = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > bv {
            bv = v;
            best = i;
        }
    }
    best as u32
}

fn log_sum_exp(logits: &[f32]) -> f32 {
    let m = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let s: f64 = logits.iter().map(|&v| ((v - m) as f64).exp()).sum();
    m + s.ln() as f32
}

fn top_n<'a>(logits: &[f32], n: usize, s: &'a mut SamplerScratch) -> &'a [u32] {
    s.idx.clear();
    if n == 0 {
        return &s.idx;
    }
    s.idx.extend(0..logits.len() as u32);
    let n = n.min(logits.len());
    let by_logit = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    if n < s.idx.len() {
        s.idx.select_nth_unstable_by(n - 1, by_logit);
    }
    s.idx.truncate(n);
    s.idx.sort_by(by_logit);
    &s.idx
}

fn sample_random(logits: &[f32], p: &SamplingParams, position: u64, s: &mut SamplerScratch) -> u32 {
    let inv_t = 1.0 / p.temperature;
    let max = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    s.idx.clear();
    if p.top_k > 0 && (p.top_k as usize) < logits.len() {
        let k = p.top_k as usize;
        s.idx.extend(0..logits.len() as u32);
        s.idx.select_nth_unstable_by(k - 1, |a, b| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        });
        s.idx.truncate(k);
    } else {
        let cut = max - TAIL_CUTOFF * p.temperature;
        s.idx
            .extend((0..logits.len() as u32).filter(|&i| logits[i as usize] >= cut));
    }
    // Best first, ties by id, so the cumulative order is deterministic.
    s.idx.sort_unstable_by(|a, b| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    });
    s.prob.clear();
    let mut total = 0f64;
    for &i in &s.idx {
        let e = (((logits[i as usize] - max) * inv_t) as f64).exp() as f32;
        s.prob.push(e);
        total += e as f64;
    }
    let mut keep = s.idx.len();
    if p.top_p < 1.0 {
        let mut cum = 0f64;
        for (j, &e) in s.prob.iter().enumerate() {
            cum += e as f64;
            if cum >= p.top_p as f64 * total {
                keep = j + 1;
                break;
            }
        }
    }
    if keep == 0 || !(total.is_finite() && total > 0.0) {
        // Non-finite logits (a NaN row from a broken model) leave nothing to
        // draw from: fall back to the argmax instead of failing the step.
        return argmax(logits);
    }
    let kept: f64 = s.prob[..keep].iter().map(|&e| e as f64).sum();
    let target = uniform(p.seed, position) * kept;
    let mut cum = 0f64;
    for j in 0..keep {
        cum += s.prob[j] as f64;
        if target < cum {
            return s.idx[j];
        }
    }
    s.idx[keep - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        (0..1000)
            .map(|i| ((i * 7919 % 1000) as f32 / 100.0) - 5.0)
            .collect()
    }

    #[test]
    fn greedy_takes_the_argmax() {
        let l = logits();
        let mut s = SamplerScratch::default();
        let got = sample(&l, &SamplingParams::greedy(), &[], None, 0, &mut s);
        let best = l.iter().cloned().fold(f32::MIN, f32::max);
        assert_eq!(l[got.token as usize], best);
    }

    #[test]
    fn same_seed_same_tokens_other_seed_other_tokens() {
        let l: Vec<f32> = (0..100).map(|i| (i % 10) as f32 * 0.1).collect();
        let p = SamplingParams {
            temperature: 1.0,
            seed: 42,
            ..Default::default()
        };
        let mut s = SamplerScratch::default();
        let a: Vec<u32> = (0..50)
            .map(|pos| sample(&l, &p, &[], None, pos, &mut s).token)
            .collect();
        let b: Vec<u32> = (0..50)
            .map(|pos| sample(&l, &p, &[], None, pos, &mut s).token)
            .collect();
        let q = SamplingParams { seed: 43, ..p };
        let c: Vec<u32> = (0..50)
            .map(|pos| sample(&l, &q, &[], None, pos, &mut s).token)
            .collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn top_k_limits_the_choice() {
        let l = logits();
        let mut order: Vec<usize> = (0..l.len()).collect();
        order.sort_by(|a, b| l[*b].total_cmp(&l[*a]));
        let allowed: Vec<u32> = order[..3].iter().map(|&i| i as u32).collect();
        let p = SamplingParams {
            temperature: 5.0,
            top_k: 3,
            ..Default::default()
        };
        let mut s = SamplerScratch::default();
        let mut seen = std::collections::HashSet::new();
        for pos in 0..300 {
            let t = sample(
                &l,
                &SamplingParams { seed: pos, ..p },
                &[],
                None,
                pos,
                &mut s,
            )
            .token;
            assert!(allowed.contains(&t));
            seen.insert(t);
        }
        assert_eq!(seen.len(), 3, "high temperature should reach all three");
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        // p(0) = 0.5, p(1) = 0.3, rest share 0.2
        let mut l = vec![(0.2f32 / 98.0).ln(); 100];
        l[0] = 0.5f32.ln();
        l[1] = 0.3f32.ln();
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 0.75,
            ..Default::default()
        };
        let mut s = SamplerScratch::default();
        let mut counts = [0u32; 2];
        for pos in 0..2000 {
            let t = sample(&l, &SamplingParams { seed: 7, ..p }, &[], None, pos, &mut s).token;
            assert!(t <= 1, "token {t} outside the 0.75 nucleus");
            counts[t as usize] += 1;
        }
        // 0.5 / 0.8 = 62.5% for token 0
        let f = counts[0] as f64 / 2000.0;
        assert!((f - 0.625).abs() < 0.05, "frequency {f}");
    }

    #[test]
    fn temperature_sampling_follows_the_distribution() {
        let l = vec![0f32, 1.0f32.ln() + 0.0, 2.0f32.ln()]; // p ∝ 1, 1, 2
        let p = SamplingParams {
            temperature: 1.0,
            seed: 9,
            ..Default::default()
        };
        let mut s = SamplerScratch::default();
        let mut c = [0u32; 3];
        for pos in 0..4000 {
            c[sample(&l, &p, &[], None, pos, &mut s).token as usize] += 1;
        }
        let f2 = c[2] as f64 / 4000.0;
        assert!((f2 - 0.5).abs() < 0.04, "{c:?}");
    }

    #[test]
    fn logprobs_are_normalised_and_ordered() {
        let l = logits();
        let p = SamplingParams {
            logprobs: true,
            top_logprobs: 5,
            ..Default::default()
        };
        let mut s = SamplerScratch::default();
        let got = sample(&l, &p, &[], None, 0, &mut s);
        assert_eq!(got.top.len(), 5);
        assert_eq!(got.top[0].0, got.token);
        assert!((got.top[0].1 - got.logprob).abs() < 1e-6);
        for w in got.top.windows(2) {
            assert!(w[0].1 >= w[1].1);
        }
        let total: f64 = l
            .iter()
            .map(|&v| ((v - got.logprob.exp().ln()) as f64).exp())
            .sum::<f64>();
        assert!(total.is_finite());
        let sum_p: f64 = l
            .iter()
            .map(|&v| ((v - l[got.token as usize] + got.logprob) as f64).exp())
            .sum();
        assert!((sum_p - 1.0).abs() < 1e-4, "probabilities sum to {sum_p}");
    }

    #[test]
    fn non_finite_logits_do_not_panic() {
        let mut s = SamplerScratch::default();
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 0.9,
            ..Default::default()
        };
        for l in [
            vec![f32::NAN; 10],
            vec![f32::INFINITY; 10],
            vec![f32::NEG_INFINITY; 10],
        ] {
            let t = sample(&l, &p, &[], None, 0, &mut s).token;
            assert!(t < 10);
        }
    }

    #[test]
    fn bad_params_are_refused() {
        assert!(
            SamplingParams {
                temperature: -1.0,
                ..Default::default()
            }
            .validate()
            .is_err()
        );
        assert!(
            SamplingParams {
                temperature: f32::NAN,
                ..Default::default()
            }
            .validate()
            .is_err()
        );
        assert!(
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            }
            .validate()
            .is_err()
        );
        assert!(
            SamplingParams {
                top_logprobs: 21,
                ..Default::default()
            }
            .validate()
            .is_err()
        );
        assert!(SamplingParams::default().validate().is_ok());
        for bad in [2.5f32, -2.01, f32::NAN] {
            let p = SamplingParams {
                presence_penalty: bad,
                ..Default::default()
            };
            assert!(p.validate().unwrap_err().contains("presence_penalty"));
            let p = SamplingParams {
                frequency_penalty: bad,
                ..Default::default()
            };
            assert!(p.validate().unwrap_err().contains("frequency_penalty"));
        }
    }

    /// A bias moves the draw and the log-probabilities with it, leaves the
    /// caller's row as it was, and skips ids past the vocabulary.
    #[test]
    fn bias_is_added_before_sampling_and_logprobs() {
        let l = logits();
        let mut s = SamplerScratch::with_capacity(l.len());
        let p = SamplingParams {
            logprobs: true,
            top_logprobs: 2,
            ..SamplingParams::greedy()
        };
        let plain = sample(&l, &p, &[], None, 0, &mut s);
        // +100 on a low token makes it the argmax; -100 on the argmax
        // removes it; an id past the vocabulary changes nothing.
        let low = l
            .iter()
            .enumerate()
            .min_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0 as u32;
        let got = sample(&l, &p, &[(low, 100.0), (5_000_000, 1e9)], None, 0, &mut s);
        assert_eq!(got.token, low);
        assert_eq!(got.top[0].0, low);
        assert!(got.logprob > -1e-3, "the forced token has all the mass");
        let got = sample(&l, &p, &[(plain.token, -100.0)], None, 0, &mut s);
        assert_ne!(got.token, plain.token);
        assert!(got.top.iter().all(|&(t, _)| t != plain.token));
        assert_eq!(
            sample(&l, &p, &[], None, 0, &mut s),
            plain,
            "the row is unchanged"
        );
        // With temperature: a bias of -100 on all but two tokens leaves
        // only those two to draw.
        let keep = [3u32, 7];
        let bias: Vec<(u32, f32)> = (0..l.len() as u32)
            .filter(|t| !keep.contains(t))
            .map(|t| (t, -100.0))
            .collect();
        let q = SamplingParams {
            temperature: 1.0,
            seed: 9,
            ..Default::default()
        };
        let drawn: std::collections::HashSet<u32> = (0..200)
            .map(|pos| sample(&l, &q, &bias, None, pos, &mut s).token)
            .collect();
        assert_eq!(
            drawn,
            keep.into_iter().collect::<std::collections::HashSet<u32>>()
        );
    }

    /// A constraint's mask: only allowed tokens are drawn, greedy or not,
    /// logprobs are over them, and a mask that allows nothing falls back to
    /// the unmasked argmax instead of failing.
    #[test]
    fn a_mask_allows_only_its_tokens() {
        let l = logits();
        let mut s = SamplerScratch::with_capacity(l.len());
        let mut words = vec![0u32; l.len().div_ceil(32)];
        let keep = [5u32, 40, 999];
        for t in keep {
            words[t as usize / 32] |= 1 << (t % 32);
        }
        let p = SamplingParams {
            logprobs: true,
            top_logprobs: 3,
            ..SamplingParams::greedy()
        };
        let got = sample(&l, &p, &[], Some(&words), 0, &mut s);
        let best = *keep
            .iter()
            .max_by(|a, b| l[**a as usize].total_cmp(&l[**b as usize]))
            .unwrap();
        assert_eq!(got.token, best);
        let mass: f32 = got.top.iter().map(|&(_, lp)| lp.exp()).sum();
        assert!(
            (mass - 1.0).abs() < 1e-4,
            "the three allowed hold all the mass"
        );
        let q = SamplingParams {
            temperature: 1.5,
            seed: 3,
            ..Default::default()
        };
        for pos in 0..100 {
            let t = sample(&l, &q, &[(5, 50.0)], Some(&words), pos, &mut s).token;
            assert!(keep.contains(&t), "{t} drawn");
        }
        let none = vec![0u32; words.len()];
        let plain = sample(&l, &p, &[], None, 0, &mut s).token;
        assert_eq!(sample(&l, &p, &[], Some(&none), 0, &mut s).token, plain);
        // The greedy fast path (no logprobs: no copy of the row) picks as
        // the full path does, biases included.
        let g = SamplingParams::greedy();
        for bias in [vec![], vec![(5u32, 30.0)], vec![(40, 12.5), (999, -40.0)]] {
            let fast = sample(&l, &g, &bias, Some(&words), 0, &mut s);
            let full = sample(&l, &p, &bias, Some(&words), 0, &mut s);
            assert_eq!(fast.token, full.token, "{bias:?}");
            assert!(fast.logprob.is_nan());
        }
        assert_eq!(sample(&l, &g, &[], Some(&none), 0, &mut s).token, plain);
    }
}
