//! Several runs in one report: the levels of a sweep (concurrency, or a
//! server flag gathered from separate runs) and each level's repeats with
//! their spread.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::report::Report;
use crate::stats::round_to;

/// A sweep: its levels in the order they ran.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sweep {
    /// `--label`.
    pub label: String,
    pub levels: Vec<Level>,
}

/// One level of a sweep and its runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Level {
    /// What differs, e.g. "concurrency 8" or a report's label.
    pub name: String,
    /// Every run (one per `--repeat`).
    pub runs: Vec<Report>,
    /// The spread of the headline figures across the runs (two or more).
    pub spread: Option<Spread>,
}

/// Mean, range and spread of one figure across repeated runs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Range {
    pub mean: f64,
    pub min: f64,
    pub max: f64,
    /// `(max - min) / mean`, in percent.
    pub spread_pct: f64,
}

impl Range {
    /// `mean [min..max] spread %`, or `-` for none (tables and pages).
    pub fn text(r: Option<Range>) -> String {
        r.map_or_else(
            || "-".into(),
            |x| {
                format!(
                    "{:.1} [{:.1}..{:.1}] {:.1} %",
                    x.mean, x.min, x.max, x.spread_pct
                )
            },
        )
    }

    /// Of `v`; `None` when empty.
    pub fn of(v: &[f64]) -> Option<Range> {
        if v.is_empty() {
            return None;
        }
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let (min, max) = v
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| {
                (a.min(x), b.max(x))
            });
        let spread_pct = if mean != 0.0 {
            (max - min) / mean * 100.0
        } else {
            0.0
        };
        // Rounded as the reports' figures are, so the JSON parses back exactly.
        let r = |x: f64| round_to(x, 4);
        Some(Range {
            mean: r(mean),
            min: r(min),
            max: r(max),
            spread_pct: r(spread_pct),
        })
    }
}

/// The headline figures' ranges over a level's runs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    pub runs: usize,
    pub output_tokens_per_s: Option<Range>,
    pub ttft_p99_ms: Option<Range>,
    pub tpot_p99_ms: Option<Range>,
    pub e2e_p99_ms: Option<Range>,
}

impl Spread {
    /// Over `runs` (two or more; else `None`).
    pub fn of(runs: &[Report]) -> Option<Spread> {
        if runs.len() < 2 {
            return None;
        }
        let pick = |f: &dyn Fn(&Report) -> Option<f64>| {
            Range::of(&runs.iter().filter_map(f).collect::<Vec<_>>())
        };
        Some(Spread {
            runs: runs.len(),
            output_tokens_per_s: pick(&|r| Some(r.output_tokens_per_s)),
            ttft_p99_ms: pick(&|r| r.ttft_ms.map(|s| s.p99)),
            tpot_p99_ms: pick(&|r| r.tpot_ms.map(|s| s.p99)),
            e2e_p99_ms: pick(&|r| r.e2e_ms.map(|s| s.p99)),
        })
    }
}

impl Level {
    /// A level of `runs`, with their spread.
    pub fn new(name: String, runs: Vec<Report>) -> Level {
        Level {
            name,
            spread: Spread::of(&runs),
            runs,
        }
    }

    /// Mean of a figure over the runs that have it.
    pub fn mean(&self, f: impl Fn(&Report) -> Option<f64>) -> Option<f64> {
        let v: Vec<f64> = self.runs.iter().filter_map(f).collect();
        Range::of(&v).map(|r| r.mean)
    }
}

fn cell(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.decimals$}"))
}

impl Sweep {
    /// One row per level (means over its runs) and, for repeated levels,
    /// the spread.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "\nflotilla-bench sweep{}",
            if self.label.is_empty() {
                String::new()
            } else {
                format!(": {}", self.label)
            }
        );
        let _ = writeln!(
            s,
            "  {:<24}{:>5}{:>12}{:>11}{:>11}{:>11}{:>11}{:>8}",
            "level", "runs", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "errors"
        );
        for l in &self.levels {
            let errors: u64 = l.runs.iter().map(|r| r.requests_failed).sum();
            let _ = writeln!(
                s,
                "  {:<24}{:>5}{:>12}{:>11}{:>11}{:>11}{:>11}{:>8}",
                l.name,
                l.runs.len(),
                cell(l.mean(|r| Some(r.output_tokens_per_s)), 1),
                cell(l.mean(|r| r.ttft_ms.map(|x| x.p50)), 1),
                cell(l.mean(|r| r.ttft_ms.map(|x| x.p99)), 1),
                cell(l.mean(|r| r.tpot_ms.map(|x| x.p50)), 2),
                cell(l.mean(|r| r.tpot_ms.map(|x| x.p99)), 2),
                errors,
            );
        }
        if self.levels.iter().any(|l| l.spread.is_some()) {
            let _ = writeln!(
                s,
                "\n  stability (spread = (max - min) / mean over the runs of a level)"
            );
            for l in &self.levels {
                let Some(sp) = &l.spread else { continue };
                let r = Range::text;
                let _ = writeln!(
                    s,
                    "  {:<24} tok/s {}; TTFT p99 {}; TPOT p99 {}",
                    l.name,
                    r(sp.output_tokens_per_s),
                    r(sp.ttft_p99_ms),
                    r(sp.tpot_p99_ms)
                );
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_gives_mean_bounds_and_spread() {
        let r = Range::of(&[90.0, 100.0, 110.0]).unwrap();
        assert_eq!((r.mean, r.min, r.max), (100.0, 90.0, 110.0));
        assert!((r.spread_pct - 20.0).abs() < 1e-9);
        assert_eq!(Range::of(&[]), None);
    }
}
