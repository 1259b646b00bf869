//! Seed swarms: one scenario run under many seeds, on every core, with
//! every failing seed reported (not only the first). A fault scenario is
//! trusted by its swarm, not by its first seeds: each seed draws another
//! interleaving of arrivals, network faults and (with `[chaos]`) fault
//! times and places.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::run::{Report, SimError, run};
use crate::scenario::Scenario;

/// One seed's result.
#[derive(Debug)]
pub struct SeedResult {
    /// The seed.
    pub seed: u64,
    /// Its report, or the first broken invariant (or why it could not run).
    pub result: Result<Report, SimError>,
    /// Wall seconds it took.
    pub wall_s: f64,
}

/// What a swarm found.
#[derive(Debug, Default)]
pub struct SwarmReport {
    /// Every seed's result, in seed order.
    pub seeds: Vec<SeedResult>,
}

impl SwarmReport {
    /// The seeds that failed, in seed order.
    pub fn failures(&self) -> impl Iterator<Item = &SeedResult> {
        self.seeds.iter().filter(|s| s.result.is_err())
    }

    /// Over all passing seeds: requests sent, finished, refused, failed
    /// and cancelled; streams moved; and every move's pause, ms.
    pub fn totals(&self) -> SwarmTotals {
        let mut t = SwarmTotals::default();
        for r in self.seeds.iter().filter_map(|s| s.result.as_ref().ok()) {
            for tier in &r.tiers {
                t.sent += tier.sent;
                t.finished += tier.finished;
                t.refused += tier.refused;
                t.failed += tier.failed;
                t.cancelled += tier.cancelled;
            }
            t.moved += r.moved;
            t.moved_by_kv += r.moved_by_kv;
            t.kv_short += r.kv_short;
            t.move_pauses_ms.extend_from_slice(&r.move_pauses_ms);
        }
        t
    }

    /// Simulated seconds over all passing seeds.
    pub fn sim_s(&self) -> f64 {
        self.seeds
            .iter()
            .filter_map(|s| s.result.as_ref().ok())
            .map(|r| r.sim_s)
            .sum()
    }
}

/// Sums over a swarm's passing seeds ([`SwarmReport::totals`]).
#[derive(Debug, Default)]
pub struct SwarmTotals {
    /// Requests sent.
    pub sent: u64,
    /// Finished normally.
    pub finished: u64,
    /// Refused at admission.
    pub refused: u64,
    /// Ended with an error after admission.
    pub failed: u64,
    /// Dropped by their clients.
    pub cancelled: u64,
    /// Streams the Router moved.
    pub moved: u64,
    /// Of those, moved with their KV.
    pub moved_by_kv: u64,
    /// P/D requests a decode node had no blocks to reserve for.
    pub kv_short: u64,
    /// Each move's pause, ms.
    pub move_pauses_ms: Vec<f64>,
}

/// Runs `sc` under `count` seeds from `first` on `jobs` threads (each
/// seed on its own current-thread runtime, so a run stays a function of
/// its seed whatever runs beside it). `each` sees every result as it
/// completes (in completion order); the report holds them in seed order.
pub fn swarm(
    sc: &Scenario,
    first: u64,
    count: u64,
    jobs: usize,
    each: &(dyn Fn(&SeedResult) + Sync),
) -> SwarmReport {
    let next = AtomicU64::new(0);
    let out = Mutex::new(Vec::with_capacity(count.min(1 << 16) as usize));
    let jobs = jobs.clamp(1, count.clamp(1, 1024) as usize);
    std::thread::scope(|scope| {
        for _ in 0..jobs {
            scope.spawn(|| {
                loop {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    if k >= count {
                        break;
                    }
                    let seed = first.saturating_add(k);
                    // The harness's own wall time, outside every simulated
                    // run (each run reads only its paused clock).
                    #[allow(clippy::disallowed_methods)]
                    let t0 = std::time::Instant::now();
                    // A panic inside the run is a failure of that seed, not
                    // the end of the swarm.
                    let result =
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(sc, seed)))
                            .unwrap_or_else(|p| {
                                let what = p
                                    .downcast_ref::<String>()
                                    .cloned()
                                    .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                                    .unwrap_or_else(|| "a panic".into());
                                Err(SimError::Invariant {
                                    seed,
                                    at_ms: 0.0,
                                    what: format!("the run panicked: {what}"),
                                })
                            });
                    // A swarm keeps every seed's figures, not its requests.
                    let result = result.map(|mut rep| {
                        rep.requests = Vec::new();
                        rep
                    });
                    let r = SeedResult {
                        seed,
                        result,
                        wall_s: t0.elapsed().as_secs_f64(),
                    };
                    each(&r);
                    out.lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push(r);
                }
            });
        }
    });
    let mut seeds = out
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    seeds.sort_by_key(|s| s.seed);
    SwarmReport { seeds }
}
