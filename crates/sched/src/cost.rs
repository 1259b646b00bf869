//! What a step costs, learned from the steps the engine ran:
//! `time = fixed + per_token * tokens + per_output * outputs` (an output is
//! a position whose logits the step computes and samples: a decode, a
//! prompt's last token, a draft to verify; on a small model the output
//! head makes such a token dearer than a prompt token), fitted by
//! exponentially weighted least squares, so the scheduler can size a step
//! for a time target (`step_time_max`, a tier's latency budget in time) on
//! whatever machine it runs. Measurements come in through
//! `Scheduler::observe_step`; nothing here reads a clock.

use std::time::Duration;

/// An exponentially weighted least-squares fit of step time on the step's
/// tokens and outputs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepCost {
    /// Decayed weight, and the decayed sums of t (tokens), o (outputs),
    /// y (seconds) and their products.
    w: f64,
    st: f64,
    so: f64,
    sy: f64,
    stt: f64,
    soo: f64,
    sto: f64,
    sty: f64,
    soy: f64,
    /// Steps observed.
    steps: u64,
}

/// The fitted cost.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostLine {
    /// Seconds a step costs whatever it holds (reading the weights once,
    /// the worker's round trip).
    pub fixed: f64,
    /// Seconds each token adds.
    pub per_token: f64,
    /// Seconds each output adds on top of its token (logits, sampling).
    pub per_output: f64,
}

impl CostLine {
    /// Seconds a decode (one token, one output) adds to a step.
    pub fn per_decode(&self) -> f64 {
        self.per_token + self.per_output
    }
}

impl StepCost {
    /// Weight kept by the old observations at each new one: the fit
    /// follows the last ~50 steps (the batch's context grows, the machine's
    /// load moves).
    const DECAY: f64 = 0.98;
    /// Steps observed before the fit is used.
    pub const WARMUP: u64 = 4;

    /// Adds one step: it computed `tokens` tokens, `outputs` of them with
    /// logits, in `elapsed`.
    pub fn observe(&mut self, tokens: usize, outputs: usize, elapsed: Duration) {
        if tokens == 0 {
            return;
        }
        let (t, o, y) = (
            tokens as f64,
            outputs.min(tokens) as f64,
            elapsed.as_secs_f64(),
        );
        let d = Self::DECAY;
        let acc = |s: &mut f64, v: f64| *s = *s * d + v;
        acc(&mut self.w, 1.0);
        acc(&mut self.st, t);
        acc(&mut self.so, o);
        acc(&mut self.sy, y);
        acc(&mut self.stt, t * t);
        acc(&mut self.soo, o * o);
        acc(&mut self.sto, t * o);
        acc(&mut self.sty, t * y);
        acc(&mut self.soy, o * y);
        self.steps += 1;
    }

    /// The fitted cost, once [`StepCost::WARMUP`] steps are in. What the
    /// steps cannot tell apart is not guessed: outputs that always came
    /// with as many tokens (decode-only steps) are charged to the tokens;
    /// token counts that hardly varied charge every second to the tokens
    /// (no fixed part), which overestimates larger steps, the safe side
    /// for a time target; a fit with a negative part falls back the same
    /// way.
    pub fn line(&self) -> Option<CostLine> {
        if self.steps < Self::WARMUP || self.st <= 0.0 {
            return None;
        }
        let w = self.w;
        let (mt, mo, my) = (self.st / w, self.so / w, self.sy / w);
        let vtt = self.stt / w - mt * mt;
        let voo = self.soo / w - mo * mo;
        let vto = self.sto / w - mt * mo;
        let vty = self.sty / w - mt * my;
        let voy = self.soy / w - mo * my;
        let ok = |l: &CostLine| {
            [l.fixed, l.per_token, l.per_output]
                .iter()
                .all(|v| v.is_finite() && *v >= 0.0)
                && l.per_token > 0.0
        };
        // Both parts, where the outputs varied apart from the tokens.
        let det = vtt * voo - vto * vto;
        if voo >= 0.25 && vtt >= 1.0 && det > 1e-3 * vtt * voo {
            let per_token = (vty * voo - voy * vto) / det;
            let per_output = (voy * vtt - vty * vto) / det;
            let l = CostLine {
                fixed: my - per_token * mt - per_output * mo,
                per_token,
                per_output,
            };
            if ok(&l) {
                return Some(l);
            }
        }
        // Tokens alone, where their counts spread by a tenth of their mean.
        if vtt >= (0.1 * mt).max(1.0).powi(2) {
            let per_token = vty / vtt;
            let l = CostLine {
                fixed: my - per_token * mt,
                per_token,
                per_output: 0.0,
            };
            if ok(&l) {
                return Some(l);
            }
        }
        Some(CostLine {
            fixed: 0.0,
            per_token: self.sy / self.st,
            per_output: 0.0,
        })
    }

    /// The most decodes a step may hold to take at most `target`, by the
    /// fit (at least 1); `None` before the fit exists.
    pub fn tokens_within(&self, target: Duration) -> Option<usize> {
        let l = self.line()?;
        Some(fits(target.as_secs_f64() - l.fixed, l.per_decode()).max(1))
    }
}

/// Speculative decoding with a draft model, as a cost sum: a step of `b`
/// decodes, each drafting `k` tokens, runs `k` draft passes of `b` rows
/// (`draft`'s line) and a verify step of `b * (k + 1)` positions
/// (`target`'s line), and yields `(1 - alpha^(k+1)) / (1 - alpha)` tokens
/// per sequence at a per-token acceptance `alpha`. The ratio of its tokens
/// per second to a plain decode step's (1.0 at `k = 0`).
pub fn draft_gain(target: &CostLine, draft: &CostLine, alpha: f64, b: usize, k: usize) -> f64 {
    let b = b.max(1) as f64;
    let alpha = alpha.clamp(0.0, 0.999);
    let tokens = (0..=k).map(|j| alpha.powi(j as i32)).sum::<f64>();
    let plain = target.fixed + b * target.per_decode();
    let spec = plain
        + b * k as f64 * target.per_decode()
        + k as f64 * (draft.fixed + b * draft.per_decode());
    if plain <= 0.0 || spec <= 0.0 {
        return 1.0;
    }
    (tokens / spec) / (1.0 / plain)
}

/// The draft length in `0..=max` with the largest [`draft_gain`], and that
/// gain; 0 (gain 1.0) unless some length gains at least `margin` (a
/// fraction: the fit's error is not worth a loss).
pub fn best_draft(
    target: &CostLine,
    draft: &CostLine,
    alpha: f64,
    b: usize,
    max: usize,
    margin: f64,
) -> (usize, f64) {
    let mut best = (0, 1.0);
    for k in 1..=max {
        let g = draft_gain(target, draft, alpha, b, k);
        if g > best.1 {
            best = (k, g);
        }
    }
    if best.1 < 1.0 + margin {
        (0, 1.0)
    } else {
        best
    }
}

/// Whole items of `per` seconds each that fit in `secs` (0 if none), a
/// millionth of an item forgiving the fit's rounding.
pub(crate) fn fits(secs: f64, per: f64) -> usize {
    let n = secs / per + 1e-6;
    if n.is_finite() && n >= 1.0 {
        n.min(u32::MAX as f64) as usize
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: f64) -> Duration {
        Duration::from_secs_f64(v / 1000.0)
    }

    /// 5 ms + 0.5 ms per token + 0.3 ms per output.
    fn cost(t: usize, o: usize) -> Duration {
        ms(5.0 + 0.5 * t as f64 + 0.3 * o as f64)
    }

    #[test]
    fn learns_each_part_from_a_mix_of_prompts_and_decodes() {
        let mut c = StepCost::default();
        assert_eq!(c.line(), None);
        assert_eq!(c.tokens_within(ms(100.0)), None);
        // Decode steps, prompt chunks, and steps with both.
        for (t, o) in [
            (1, 1),
            (32, 32),
            (512, 1),
            (8, 8),
            (200, 9),
            (64, 1),
            (40, 40),
            (300, 20),
        ] {
            c.observe(t, o, cost(t, o));
        }
        let l = c.line().unwrap();
        assert!((l.fixed - 0.005).abs() < 1e-6, "{l:?}");
        assert!((l.per_token - 0.0005).abs() < 1e-8, "{l:?}");
        assert!((l.per_output - 0.0003).abs() < 1e-8, "{l:?}");
        // (100 - 5) / 0.8 = 118 decodes.
        assert_eq!(c.tokens_within(ms(100.0)), Some(118));
        // A target below the fixed cost still lets one token through.
        assert_eq!(c.tokens_within(ms(2.0)), Some(1));
        // Empty steps teach nothing.
        let before = c.clone();
        c.observe(0, 0, ms(50.0));
        assert_eq!(c, before);
    }

    #[test]
    fn decode_only_steps_charge_the_outputs_to_the_tokens() {
        let mut c = StepCost::default();
        for i in 0..40 {
            let n = 1 + (i * 7) % 32;
            c.observe(n, n, cost(n, n));
        }
        let l = c.line().unwrap();
        assert_eq!(l.per_output, 0.0);
        assert!((l.fixed - 0.005).abs() < 1e-6, "{l:?}");
        assert!((l.per_decode() - 0.0008).abs() < 1e-8, "{l:?}");
        assert_eq!(c.tokens_within(ms(100.0)), Some(118));
    }

    #[test]
    fn follows_a_machine_that_slows_down() {
        let mut c = StepCost::default();
        for i in 0..100 {
            let n = 1 + (i * 37) % 128;
            c.observe(n, n, ms(2.0 + 0.25 * n as f64));
        }
        // (50 - 2) / 0.25 = 192.
        assert_eq!(c.tokens_within(ms(50.0)).unwrap(), 192);
        for i in 0..300 {
            let n = 1 + (i * 37) % 128;
            c.observe(n, n, ms(4.0 + 1.0 * n as f64));
        }
        let slow = c.tokens_within(ms(50.0)).unwrap();
        assert!((45..=46).contains(&slow), "{slow}");
    }

    #[test]
    fn same_sized_steps_charge_every_second_to_the_tokens() {
        let mut c = StepCost::default();
        for _ in 0..10 {
            c.observe(32, 32, ms(48.0));
        }
        let l = c.line().unwrap();
        assert_eq!((l.fixed, l.per_output), (0.0, 0.0));
        assert!((l.per_token - 0.0015).abs() < 1e-9);
        // 100 ms / 1.5 ms = 66 tokens: fewer than the true line (if part of
        // the 48 ms is fixed) would allow, never more.
        assert_eq!(c.tokens_within(ms(100.0)), Some(66));
        // Noise that makes bigger steps look cheaper is not believed.
        let mut c = StepCost::default();
        for (n, t) in [(10, 30.0), (100, 20.0), (10, 31.0), (100, 19.0), (50, 25.0)] {
            c.observe(n, 1, ms(t));
        }
        let l = c.line().unwrap();
        assert_eq!(l.fixed, 0.0);
        assert!(l.per_token > 0.0);
    }

    #[test]
    fn a_draft_pays_where_steps_are_bound_by_the_weights_and_turns_down_as_streams_grow() {
        // A step reads the weights once (40 ms) and each position adds 2 ms;
        // the draft model's pass costs 10 ms + 0.5 ms a row.
        let target = CostLine {
            fixed: 0.040,
            per_token: 0.002,
            per_output: 0.0,
        };
        let draft = CostLine {
            fixed: 0.010,
            per_token: 0.0005,
            per_output: 0.0,
        };
        // k = 0 is a plain step.
        assert!((draft_gain(&target, &draft, 0.7, 1, 0) - 1.0).abs() < 1e-12);
        // One stream, alpha 0.7, k = 3: (1+.7+.49+.343) = 2.533 tokens in
        // 42 + 6 + 31.5 = 79.5 ms against 1 in 42 ms: 1.338x.
        let g = draft_gain(&target, &draft, 0.7, 1, 3);
        assert!((g - 2.533 * 42.0 / 79.5).abs() < 1e-3, "{g}");
        let (k, gain) = best_draft(&target, &draft, 0.7, 1, 8, 0.02);
        assert!(k >= 2 && gain > 1.3, "{k} {gain}");
        // Many streams: verify positions cost as much as the tokens they
        // may save, and the draft is turned off.
        let (k, gain) = best_draft(&target, &draft, 0.7, 64, 8, 0.02);
        assert_eq!((k, gain), (0, 1.0));
        // A draft that is rarely right never pays.
        assert_eq!(best_draft(&target, &draft, 0.05, 1, 8, 0.02).0, 0);
        // More acceptance, longer drafts.
        let lo = best_draft(&target, &draft, 0.6, 1, 16, 0.0).0;
        let hi = best_draft(&target, &draft, 0.95, 1, 16, 0.0).0;
        assert!(hi > lo, "{lo} {hi}");
    }
}
