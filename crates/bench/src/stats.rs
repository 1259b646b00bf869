//! Percentiles and summaries of latency samples.

use serde::{Deserialize, Serialize};

/// The `p`-th percentile (0..=100) of ascending `sorted` by the nearest-rank
/// method: the smallest sample with at least `p`% of samples at or below it.
/// `None` for no samples; `p = 0` gives the minimum.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    assert!((0.0..=100.0).contains(&p), "percentile {p} outside 0..=100");
    debug_assert!(sorted.is_sorted_by(|a, b| a <= b), "samples not sorted");
    if sorted.is_empty() {
        return None;
    }
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// `x` rounded to `decimals` places. Reports keep figures short so their
/// JSON is readable and parses back to the same `f64` (few digits stay on
/// serde_json's exact parsing path).
pub fn round_to(x: f64, decimals: i32) -> f64 {
    let scale = 10f64.powi(decimals);
    (x * scale).round() / scale
}

/// Decimal places kept in millisecond figures (0.1 microsecond).
const MS_DECIMALS: i32 = 4;

/// Distribution of one latency figure, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Number of samples.
    pub count: u64,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Summary {
    /// Summary of `samples` (any order; sorted in place). `None` if empty.
    pub fn of(samples: &mut [f64]) -> Option<Self> {
        if samples.is_empty() {
            return None;
        }
        samples.sort_by(f64::total_cmp);
        let s = &*samples;
        let r = |x: f64| round_to(x, MS_DECIMALS);
        Some(Self {
            count: s.len() as u64,
            mean: r(s.iter().sum::<f64>() / s.len() as f64),
            p50: r(percentile(s, 50.0)?),
            p90: r(percentile(s, 90.0)?),
            p99: r(percentile(s, 99.0)?),
            max: r(s[s.len() - 1]),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_nearest_rank() {
        let s: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile(&s, 0.0), Some(1.0));
        assert_eq!(percentile(&s, 10.0), Some(1.0));
        assert_eq!(percentile(&s, 11.0), Some(2.0));
        assert_eq!(percentile(&s, 50.0), Some(5.0));
        assert_eq!(percentile(&s, 90.0), Some(9.0));
        assert_eq!(percentile(&s, 99.0), Some(10.0));
        assert_eq!(percentile(&s, 100.0), Some(10.0));
        // Wikipedia's worked example: 15 20 35 40 50.
        let w = [15.0, 20.0, 35.0, 40.0, 50.0];
        assert_eq!(percentile(&w, 5.0), Some(15.0));
        assert_eq!(percentile(&w, 30.0), Some(20.0));
        assert_eq!(percentile(&w, 40.0), Some(20.0));
        assert_eq!(percentile(&w, 50.0), Some(35.0));
        assert_eq!(percentile(&w, 100.0), Some(50.0));
    }

    #[test]
    fn percentile_edge_cases() {
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&[7.0], 0.0), Some(7.0));
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
    }

    #[test]
    fn summary_sorts_and_orders() {
        let mut v = vec![5.0, 1.0, 3.0, 2.0, 4.0];
        let s = Summary::of(&mut v).unwrap();
        assert_eq!(
            (s.count, s.mean, s.p50, s.p99, s.max),
            (5, 3.0, 3.0, 5.0, 5.0)
        );
        assert!(s.p50 <= s.p90 && s.p90 <= s.p99);
        assert_eq!(Summary::of(&mut []), None);
    }

    #[test]
    fn rounded_figures_survive_json() {
        let mut v = vec![20.446219000000003, 0.1 + 0.2, 1e-9, 123456.789012345];
        let s = Summary::of(&mut v).unwrap();
        assert_eq!((s.p50, s.max), (0.3, 123456.789));
        assert_eq!(round_to(20.446219000000003, 4), 20.4462);
        let back: Summary = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(back, s);
    }
}
