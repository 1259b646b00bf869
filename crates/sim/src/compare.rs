//! Fast mode held to the exact mode: one scenario and seed run both ways,
//! request by request (`flotilla simulate FILE --fast --compare`, and the
//! scenario test over every fault-free scenario in `simulations/`).

use std::time::{Duration, Instant};

use crate::run::{End, Report, RequestRecord, SimError, run};
use crate::scenario::{Scenario, SimMode};

/// How far fast mode may stray from the exact mode on one request: 1% of
/// the exact figure, or one timer tick (1 ms, the simulated clock's grain)
/// where that is more.
pub const TOLERANCE: f64 = 0.01;

/// The simulated clock's grain: a figure under 100 ms may differ by this.
pub const TICK: Duration = Duration::from_millis(1);

/// One figure's worst request.
#[derive(Clone, Debug, PartialEq)]
pub struct Worst {
    /// The request.
    pub id: u64,
    /// Its figure in the exact mode, ms.
    pub exact_ms: f64,
    /// In fast mode, ms.
    pub fast_ms: f64,
}

impl Worst {
    /// `|fast - exact| / exact`.
    pub fn rel(&self) -> f64 {
        (self.fast_ms - self.exact_ms).abs() / self.exact_ms.max(1e-9)
    }

    /// Whether it is within [`TOLERANCE`] (or a tick).
    pub fn holds(&self) -> bool {
        let diff = (self.fast_ms - self.exact_ms).abs();
        diff <= TOLERANCE * self.exact_ms || diff <= TICK.as_secs_f64() * 1e3
    }
}

/// How one run ended a request: its end and the tokens its client had.
pub type Ending = (End, u64);

/// A scenario and seed, run exact and fast.
#[derive(Clone, Debug)]
pub struct Comparison {
    /// The exact run.
    pub exact: Report,
    /// The fast run.
    pub fast: Report,
    /// Wall time of each, seconds.
    pub wall_s: (f64, f64),
    /// Requests whose outcome differs: id (the exact run's), exact, fast
    /// (each its end and tokens; a request one run did not send is
    /// `Refused` after 0 there).
    pub outcome_diffs: Vec<(u64, Ending, Ending)>,
    /// Requests both modes ran to the end whose figures differ by more than
    /// [`TOLERANCE`].
    pub over: usize,
    /// Requests compared (finished in both).
    pub compared: usize,
    /// The worst request of each figure: TTFT, TPOT, latency (sent to
    /// its end).
    pub worst: [Option<Worst>; 3],
}

impl Comparison {
    /// Whether fast mode equals the exact mode: the same requests, each
    /// ending the same way, every figure within [`TOLERANCE`].
    pub fn equal(&self) -> bool {
        self.exact.requests.len() == self.fast.requests.len()
            && self.outcome_diffs.is_empty()
            && self.over == 0
    }
}

impl std::fmt::Display for Comparison {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "exact {:.2} s wall, fast {:.2} s wall ({:.1}x); {} requests exact, {} fast; \
             {} outcomes differ; {} of {} finished requests outside {:.0}%",
            self.wall_s.0,
            self.wall_s.1,
            self.wall_s.0 / self.wall_s.1.max(1e-9),
            self.exact.requests.len(),
            self.fast.requests.len(),
            self.outcome_diffs.len(),
            self.over,
            self.compared,
            TOLERANCE * 100.0
        )?;
        for (name, w) in ["TTFT", "TPOT", "latency"].iter().zip(&self.worst) {
            match w {
                Some(w) => writeln!(
                    f,
                    "  worst {name:<7}: request {} exact {:.3} ms, fast {:.3} ms ({:+.3}%)",
                    w.id,
                    w.exact_ms,
                    w.fast_ms,
                    100.0 * (w.fast_ms - w.exact_ms) / w.exact_ms.max(1e-9)
                )?,
                None => writeln!(f, "  worst {name:<7}: none compared")?,
            }
        }
        for (id, e, x) in self.outcome_diffs.iter().take(10) {
            writeln!(
                f,
                "  request {id}: exact {:?} after {} tokens, fast {:?} after {}",
                e.0, e.1, x.0, x.1
            )?;
        }
        if !self.fast.exact_spans.is_empty() {
            let spans: Vec<String> = self
                .fast
                .exact_spans
                .iter()
                .map(|(a, b)| format!("{a:.1}-{b:.1} s"))
                .collect();
            writeln!(f, "  fast mode ran step by step in {}", spans.join(", "))?;
        }
        Ok(())
    }
}

/// Runs `sc` with `seed` in both modes and compares them request by
/// request.
// The harness's own wall time, outside both simulated runs.
#[allow(clippy::disallowed_methods)]
pub fn compare(sc: &Scenario, seed: u64) -> Result<Comparison, SimError> {
    let mut exact_sc = sc.clone();
    exact_sc.sim.mode = SimMode::Exact;
    let mut fast_sc = sc.clone();
    fast_sc.sim.mode = SimMode::Fast;
    let t = Instant::now();
    let exact = run(&exact_sc, seed)?;
    let exact_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let fast = run(&fast_sc, seed)?;
    let fast_s = t.elapsed().as_secs_f64();
    Ok(diff(exact, fast, (exact_s, fast_s)))
}

/// Compares two reports of one scenario and seed.
pub fn diff(exact: Report, fast: Report, wall_s: (f64, f64)) -> Comparison {
    let by_key: std::collections::BTreeMap<u64, &RequestRecord> =
        fast.requests.iter().map(|r| (r.key, r)).collect();
    let mut outcome_diffs = Vec::new();
    let mut worst: [Option<Worst>; 3] = [None, None, None];
    let (mut over, mut compared) = (0, 0);
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    for e in &exact.requests {
        let Some(x) = by_key.get(&e.key) else {
            outcome_diffs.push((e.id, (e.end, e.tokens), (End::Refused, 0)));
            continue;
        };
        // A cancel comes after a drawn number of tokens: its tokens are
        // the same in both, its time is where fast mode's tokens arrive.
        if e.end != x.end || (e.end != End::Cancelled && e.tokens != x.tokens) {
            outcome_diffs.push((e.id, (e.end, e.tokens), (x.end, x.tokens)));
            continue;
        }
        if e.end != End::Finished {
            continue;
        }
        compared += 1;
        let figures = [
            (e.ttft.map(ms), x.ttft.map(ms)),
            (e.tpot.map(ms), x.tpot.map(ms)),
            (Some(ms(e.ended - e.sent)), Some(ms(x.ended - x.sent))),
        ];
        let mut out = false;
        for (k, fig) in figures.into_iter().enumerate() {
            let (Some(a), Some(b)) = fig else {
                continue;
            };
            let w = Worst {
                id: e.id,
                exact_ms: a,
                fast_ms: b,
            };
            out |= !w.holds();
            if worst[k].as_ref().is_none_or(|o| w.rel() > o.rel()) {
                worst[k] = Some(w);
            }
        }
        over += usize::from(out);
    }
    Comparison {
        exact,
        fast,
        wall_s,
        outcome_diffs,
        over,
        compared,
        worst,
    }
}
