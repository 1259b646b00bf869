//! The run's one source of randomness: SplitMix64, seeded from the
//! scenario seed. Every random choice (arrivals, lengths, tokens, faults)
//! comes from a stream split off it by a fixed label, so adding a stream
//! does not shift the others.

/// A seeded generator (SplitMix64: fast, 64-bit state, passes BigCrush).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// An independent stream for `label` (a node index, a tenant index...).
    pub fn split(&self, label: u64) -> Rng {
        let mut r = Rng(self.0 ^ label.wrapping_mul(0xD6E8_FEB8_6659_FD93));
        r.next_u64();
        Rng(r.next_u64())
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut s = flotilla_exec::rng::SplitMix64(self.0);
        let z = s.next_u64();
        self.0 = s.0;
        z
    }

    /// Uniform in `[0, 1)`.
    pub fn f64(&mut self) -> f64 {
        flotilla_exec::rng::unit_f64(self.next_u64())
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        debug_assert!(lo <= hi);
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.f64() < p
    }

    /// Exponential with mean `mean`.
    pub fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.f64()).ln()
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.f64();
        let u2 = self.f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Lognormal: `exp(mu + sigma * N(0, 1))`.
    pub fn lognormal(&mut self, mu: f64, sigma: f64) -> f64 {
        (mu + sigma * self.normal()).exp()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_repeat_from_their_seed_and_differ_by_label() {
        let a: Vec<u64> = (0..4).map(|_| Rng::new(7).split(1).next_u64()).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        let mut x = Rng::new(7).split(1);
        let mut y = Rng::new(7).split(2);
        assert_ne!(x.next_u64(), y.next_u64());
        let mut r = Rng::new(1);
        let mean = (0..20_000).map(|_| r.exp(2.0)).sum::<f64>() / 20_000.0;
        assert!((mean - 2.0).abs() < 0.1, "{mean}");
        let med = {
            let mut v: Vec<f64> = (0..20_001).map(|_| r.lognormal(5.0, 0.5)).collect();
            v.sort_by(f64::total_cmp);
            v[10_000]
        };
        assert!((med / 5f64.exp() - 1.0).abs() < 0.05, "{med}");
    }
}
