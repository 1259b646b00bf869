//! One simulation run: the real Router (`ClusterEngine`), the real engine
//! node bridge (`run_worker`) and the real Scheduler and GpuWorker actors
//! (`spawn_engine`), on a current-thread tokio runtime with a paused clock,
//! over [`SimNet`], with [`SimExecutor`] for the forward pass. Clients drive
//! the Router through the same `Engine` trait the HTTP gateway uses.
//!
//! Determinism: one thread, a paused clock that jumps to the next timer,
//! every random choice from the seeded [`Rng`], ordered maps. The trace of
//! what the clients saw (submits, tokens, ends, with their simulated times)
//! is hashed: the same scenario and seed give the same hash.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use flotilla_actors::{Clock, EngineOptions, InvariantHook, LocalEngine, spawn_engine};
use flotilla_cluster::{
    CheckHook, ClusterEngine, OrphanHook, RouterHooks, WorkerEnd, WorkerOptions, node_settings,
    router_options, run_worker,
};
use flotilla_engine::{Engine, StreamChunk};
use flotilla_exec::Executor;
use flotilla_proto::{
    EngineEvent, EngineFailure, EngineRequest, FinishReason, Rejection, Role, SamplingParams,
    TenantId,
};
use flotilla_sched::SchedConfig;
use flotilla_telemetry::Metrics;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::exec::{DecodeLog, DecodeTap, SimExecutor};
use crate::scenario::{Arrivals, FaultKind, Lengths, Scenario, ScenarioError, SimMode};
use flotilla_exec::rng::Rng;
use flotilla_transport::Transport;
use flotilla_transport::sim::{FaultCounts, SimNet};

/// Why a run did not complete.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The scenario cannot run.
    #[error(transparent)]
    Scenario(#[from] ScenarioError),
    /// The runtime or an actor could not start.
    #[error("starting the simulation: {0}")]
    Start(String),
    /// An invariant broke: replay with the same seed to see it again.
    #[error("invariant broken (seed {seed}) at t={at_ms:.3} ms: {what}")]
    Invariant {
        /// The run's seed.
        seed: u64,
        /// Simulated time of the event that broke it.
        at_ms: f64,
        /// Which invariant and the event.
        what: String,
    },
}

/// Latency summary of one tier.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TierReport {
    /// Tier name.
    pub name: String,
    /// Requests sent.
    pub sent: u64,
    /// Finished normally.
    pub finished: u64,
    /// Refused at admission (HTTP 429/503 in a real deployment).
    pub refused: u64,
    /// Ended with an error after admission.
    pub failed: u64,
    /// Dropped by their client mid-stream.
    pub cancelled: u64,
    /// Finished within the tier's TTFT and TPOT objectives.
    pub within_slo: u64,
    /// TTFT p50 / p99, ms.
    pub ttft_ms: (f64, f64),
    /// Mean TPOT per request, p50 / p99, ms.
    pub tpot_ms: (f64, f64),
    /// Its fair-share weight among the tiers (`[[tiers]] weight`).
    pub weight: u32,
    /// KV blocks no lower tier may take, per engine
    /// (`[[tiers]] kv_reserved_blocks`).
    pub kv_reserved_blocks: u32,
}

/// One tenant's share of a run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TenantReport {
    /// Name.
    pub name: String,
    /// Its tier's name.
    pub tier: String,
    /// Its fair-share weight within the tier.
    pub weight: u32,
    /// Requests sent.
    pub sent: u64,
    /// Finished normally.
    pub finished: u64,
    /// Refused at admission.
    pub refused: u64,
    /// Output tokens its clients received (finished or not).
    pub output_tokens: u64,
}

/// What a run measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Report {
    /// The run's seed.
    pub seed: u64,
    /// Per tier.
    pub tiers: Vec<TierReport>,
    /// Per tenant.
    pub tenants: Vec<TenantReport>,
    /// Simulated seconds from the first arrival to the last end.
    pub sim_s: f64,
    /// Output tokens of finished requests.
    pub output_tokens: u64,
    /// Mean fraction of KV blocks in use, sampled every 100 ms on every live engine.
    pub kv_util: f64,
    /// Preemptions on engines alive at the end.
    pub preemptions: u64,
    /// The KV offload tiers of the engines alive at the end, together.
    pub offload: flotilla_proto::KvOffload,
    /// Faults that fired.
    pub faults: FaultCounts,
    /// Pipeline groups that formed again after a lost stage, in all.
    pub groups_formed_again: u64,
    /// Orphaned leases the nodes found and gave back, all while a link
    /// was cut or soon after (any other breaks the run).
    pub orphans: u64,
    /// Streaming requests the Router moved to another node when theirs
    /// was lost.
    pub moved: u64,
    /// Of those, the ones that continued from their KV (their node left
    /// in order), not by recomputing their tokens.
    pub moved_by_kv: u64,
    /// P/D requests a decode node had no KV blocks to reserve for (sent
    /// to another decode node, or run whole there).
    pub kv_short: u64,
    /// Streams that broke off because their Router died (counted as
    /// failed in their tier; any other stream that ends without a
    /// terminal event breaks the run).
    pub cut_by_router: u64,
    /// Requests placed through each Router (first placements; the
    /// Routers' own counts, summed over their lives).
    pub placed_by_router: Vec<u64>,
    /// Streams whose longest pause between two tokens outlasted the down
    /// bound (a lost node, a cut link), and those pauses, ms.
    pub pauses_ms: Vec<f64>,
    /// Each move's pause from the last token on one engine to the first on
    /// the next, ms (runs with `check_every_step`, which logs decodes).
    pub move_pauses_ms: Vec<f64>,
    /// The engine nodes a Router that is up knows at the end (a joined
    /// node that left and was forgotten is not among them): name, up,
    /// requests placed there.
    pub nodes: Vec<(String, bool, u64)>,
    /// Every request, by key.
    pub requests: Vec<RequestRecord>,
    /// Fast mode: the spans it ran step by step around faults, simulated
    /// seconds from the first arrival (none in the exact mode).
    pub exact_spans: Vec<(f64, f64)>,
    /// Events in the trace.
    pub events: u64,
    /// FNV-1a hash of the trace.
    pub trace_hash: u64,
}

/// One request as its client saw it.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestRecord {
    /// Its id (the simulator numbers requests as it sends them).
    pub id: u64,
    /// Its tenant (high 16 bits) and its place in the tenant's traffic:
    /// the same request in any run of the scenario and seed, whatever
    /// the timing.
    pub key: u64,
    /// Its tier (an index into the scenario's tiers).
    pub tier: usize,
    /// How it ended.
    pub end: End,
    /// Tokens its client received.
    pub tokens: u64,
    /// When it was sent, since the run's start.
    pub sent: Duration,
    /// Time to its first token.
    pub ttft: Option<Duration>,
    /// Its mean time per output token after the first.
    pub tpot: Option<Duration>,
    /// When its stream ended (its terminal event, its refusal or its
    /// client's cancel), since the run's start.
    pub ended: Duration,
}

impl Report {
    /// Finished output tokens per simulated second.
    pub fn throughput(&self) -> f64 {
        self.output_tokens as f64 / self.sim_s.max(1e-9)
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{:<10} {:>6} {:>6} {:>6} {:>6} {:>6} {:>9} {:>9} {:>9} {:>9} {:>8}",
            "tier",
            "sent",
            "ok",
            "refuse",
            "failed",
            "cancel",
            "TTFT p50",
            "TTFT p99",
            "TPOT p50",
            "TPOT p99",
            "goodput"
        )?;
        for t in &self.tiers {
            let good = 100.0 * t.within_slo as f64 / (t.sent - t.cancelled).max(1) as f64;
            writeln!(
                f,
                "{:<10} {:>6} {:>6} {:>6} {:>6} {:>6} {:>7.0}ms {:>7.0}ms {:>7.1}ms {:>7.1}ms {:>7.1}%",
                t.name,
                t.sent,
                t.finished,
                t.refused,
                t.failed,
                t.cancelled,
                t.ttft_ms.0,
                t.ttft_ms.1,
                t.tpot_ms.0,
                t.tpot_ms.1,
                good
            )?;
        }
        // What protects each tier beyond its queue: its weight among
        // several tiers, a KV reservation.
        let several = self.tiers.len() > 1;
        for t in &self.tiers {
            if several || t.kv_reserved_blocks > 0 {
                writeln!(
                    f,
                    "  tier {:<14} weight {}, {} KV blocks reserved per engine",
                    t.name, t.weight, t.kv_reserved_blocks
                )?;
            }
        }
        // Tenants sharing a tier: how the tier's share split (by weight).
        let shared = |tier: &str| self.tenants.iter().filter(|t| t.tier == tier).count() > 1;
        for t in self.tenants.iter().filter(|t| shared(&t.tier)) {
            writeln!(
                f,
                "  tenant {:<12} (tier {}, weight {}): sent {}, ok {}, refused {}, {} output tokens",
                t.name, t.tier, t.weight, t.sent, t.finished, t.refused, t.output_tokens
            )?;
        }
        writeln!(
            f,
            "throughput {:.1} output tok/s over {:.1} simulated s; KV use {:.1}% (mean); preemptions {}",
            self.throughput(),
            self.sim_s,
            100.0 * self.kv_util,
            self.preemptions
        )?;
        let o = &self.offload;
        if o.total > 0 {
            writeln!(
                f,
                "KV offload: {} slots, {} held at the end; spilled {}, restored {}, dropped {}; \
                 {} of {} lookups past the cache restored blocks",
                o.total, o.held, o.spilled, o.restored, o.dropped, o.hits, o.lookups
            )?;
        }
        let x = &self.faults;
        writeln!(
            f,
            "faults fired: lost+resent {}, duplicated {}, reordered {}, held by a partition {}, \
             held by a clog {}, dropped at idle timeout {}, crashes {}, restarts {}, \
             drains {} (left {})",
            x.lost,
            x.duplicated,
            x.reordered,
            x.partitioned,
            x.clogged,
            x.dropped,
            x.crashes,
            x.restarts,
            x.drains,
            x.drained
        )?;
        if x.router_crashes + x.router_restarts > 0 || self.cut_by_router > 0 {
            writeln!(
                f,
                "routers: crashed {}, back {}; streams cut with their router {}; placed through \
                 each {:?}",
                x.router_crashes, x.router_restarts, self.cut_by_router, self.placed_by_router
            )?;
        }
        if x.joins > 0 {
            writeln!(f, "joins (nodes in no config): {}", x.joins)?;
        }
        if x.stage_crashes + x.stage_restarts > 0 {
            writeln!(
                f,
                "pipeline stages: crashed {}, back {}; groups formed again {}",
                x.stage_crashes, x.stage_restarts, self.groups_formed_again
            )?;
        }
        if self.orphans > 0 {
            writeln!(
                f,
                "orphaned leases given back while a link was cut or soon after: {}",
                self.orphans
            )?;
        }
        if self.moved > 0 || !self.pauses_ms.is_empty() {
            let mut p = self.pauses_ms.clone();
            writeln!(
                f,
                "moves: {} streams continued on another node after theirs was lost or left ({} with \
                 their KV); {} streams paused past the down bound, longest pause p50 {:.0} ms, \
                 p99 {:.0} ms",
                self.moved,
                self.moved_by_kv,
                p.len(),
                percentile(&mut p, 50.0),
                percentile(&mut p, 99.0)
            )?;
        }
        if self.kv_short > 0 {
            writeln!(
                f,
                "P/D requests whose decode node was short of KV blocks to reserve: {} (sent to \
                 another decode node, or run whole there)",
                self.kv_short
            )?;
        }
        if !self.move_pauses_ms.is_empty() {
            let mut p = self.move_pauses_ms.clone();
            writeln!(
                f,
                "move pauses (last token on one engine to the first on the next): {} moves, \
                 p50 {:.0} ms, p99 {:.0} ms",
                p.len(),
                percentile(&mut p, 50.0),
                percentile(&mut p, 99.0)
            )?;
        }
        if x.transfers > 0 {
            writeln!(
                f,
                "KV transfers: {}, {:.2} GB modelled; {} to a crashed node hung until the idle timeout",
                x.transfers,
                x.transfer_bytes as f64 / 1e9,
                x.transfers_hung
            )?;
        }
        write!(
            f,
            "trace: {} events, hash {:016x} (seed {})",
            self.events, self.trace_hash, self.seed
        )
    }
}

/// Runs `sc` with `seed` to the end.
pub fn run(sc: &Scenario, seed: u64) -> Result<Report, SimError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .map_err(|e| SimError::Start(e.to_string()))?;
    rt.block_on(simulate(sc, seed))
}

/// Time for the actors: the paused runtime clock.
struct SimClock(Instant);

impl Clock for SimClock {
    fn now(&self) -> Duration {
        Instant::now().saturating_duration_since(self.0)
    }
}

/// What the clients saw, in order, hashed as it grows.
struct Trace {
    t0: Instant,
    hash: u64,
    events: u64,
    broken: Option<(f64, String)>,
}

impl Trace {
    fn record(&mut self, req: u64, kind: u8, value: u64) {
        let ns = Instant::now().saturating_duration_since(self.t0).as_nanos() as u64;
        for b in ns
            .to_le_bytes()
            .into_iter()
            .chain(req.to_le_bytes())
            .chain([kind])
            .chain(value.to_le_bytes())
        {
            self.hash = (self.hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        self.events += 1;
    }

    fn violate(&mut self, what: String) {
        if self.broken.is_none() {
            let at = Instant::now().saturating_duration_since(self.t0);
            self.broken = Some((at.as_secs_f64() * 1e3, what));
        }
    }
}

/// One request's outcome, for the report.
#[derive(Clone, Debug)]
struct Outcome {
    id: u64,
    key: u64,
    sent: Duration,
    ended: Duration,
    tier: usize,
    tenant: usize,
    end: End,
    ttft: Option<Duration>,
    tpot: Option<Duration>,
    tokens: u64,
    /// The longest wait between two of its tokens.
    gap_max: Duration,
}

/// How a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    /// Its last token came with its finish.
    Finished,
    /// Refused at admission.
    Refused,
    /// Ended with an error after admission.
    Failed,
    /// Its client dropped it mid-stream.
    Cancelled,
}

const SUBMIT: u8 = 1;
const TOKEN: u8 = 2;
const FINISHED: u8 = 3;
const FAILED: u8 = 4;
const REFUSED: u8 = 5;
const CANCELLED: u8 = 6;

/// Everything the run's tasks share.
struct World {
    sc: Scenario,
    net: Arc<SimNet>,
    /// The Routers, the first at node 0.
    routers: Vec<RouterSlot>,
    /// Its Routers' bookkeeping checks report here (with their time).
    router_check: Option<CheckHook>,
    /// Requests each Router placed, summed over its past lives.
    placed: Mutex<Vec<u64>>,
    /// Streams that broke off with their Router.
    cut_by_router: Mutex<u64>,
    engines: Mutex<Vec<Option<LocalEngine>>>,
    /// Each running engine node's drain switch.
    drains: Mutex<Vec<Option<tokio::sync::watch::Sender<Option<Duration>>>>>,
    trace: Mutex<Trace>,
    outcomes: Mutex<Vec<Outcome>>,
    next_req: Mutex<u64>,
    t0: Instant,
    kv_samples: Mutex<(f64, u64)>,
    sched: SchedConfig,
    rng: Rng,
    /// Which engines decoded which request, when.
    decodes: Arc<DecodeLog>,
    /// Times some link was cut (partition or clog) and when it was
    /// restored, since the run's start.
    cuts: Mutex<Cuts>,
    /// Orphaned leases given back within a fault's reach.
    orphans: Mutex<u64>,
    /// Each engine node's pipeline stages' health (`[pipeline]`), by node.
    stages: Vec<Arc<crate::exec::StageHealth>>,
    /// With a draft model: each request's acceptance (its tenant's).
    acceptance: Arc<crate::exec::Acceptance>,
    /// Fast mode: set inside its exact spans (every engine's multi-step
    /// plans end after each step).
    single: Option<Arc<std::sync::atomic::AtomicBool>>,
}

/// One Router: its node, its engine while it is up, and its life (bumped
/// at each crash, so a client can tell its stream broke with it).
struct RouterSlot {
    node: u32,
    engine: Mutex<Option<ClusterEngine>>,
    life: Mutex<u64>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

async fn simulate(sc: &Scenario, seed: u64) -> Result<Report, SimError> {
    let fast = sc.sim.mode == SimMode::Fast;
    if fast && let Some(why) = sc.fast_refusal() {
        return Err(SimError::Scenario(ScenarioError::Invalid(why)));
    }
    let root = Rng::new(seed);
    let gpu = sc.gpu_params()?;
    let shape = sc.model_shape()?;
    let e = &sc.engine;
    let probe = SimExecutor::with_stages(
        gpu.clone(),
        shape.clone(),
        e.block_size,
        e.max_num_batched_tokens,
        root.split(0),
        sc.stages(),
    )
    .map_err(|m| SimError::Scenario(ScenarioError::Invalid(m)))?;
    // A draft model beside the model takes its weights' room, and its KV
    // shares the model's blocks.
    let draft = sc.draft_shape()?;
    let acceptance = Arc::new(crate::exec::Acceptance::default());
    let probe = match &draft {
        Some(d) => probe
            .with_draft(d, acceptance.clone())
            .map_err(|m| SimError::Scenario(ScenarioError::Invalid(m)))?,
        None => probe,
    };
    let block_bytes = e.block_size
        * (shape.kv_bytes_per_token() + draft.as_ref().map_or(0, |d| d.kv_bytes_per_token()));
    // The Scheduler's settings from the scenario's config tables, built
    // and checked by the same code as `flotilla serve`'s.
    let cfg = &sc.config;
    let invalid = |m: String| SimError::Scenario(ScenarioError::Invalid(m));
    let mut sched = cfg
        .sched_config(
            e,
            sc.max_model_len,
            (probe.kv_spec().num_blocks as u32, block_bytes as u64),
            Vec::new(),
        )
        .map_err(invalid)?;
    if fast {
        // Steady decode as one plan until something happens.
        sched.decode_steps = flotilla_sched::DECODE_STEPS_MAX;
    }
    let n = sc.engine_nodes();
    let mut link = sc.network.clone();
    link.kv_bytes_per_token = shape.kv_bytes_per_token() as u64;
    // Node 0 the first Router, the engines, then the other Routers.
    let roles: Vec<Role> = std::iter::once(Role::Router)
        .chain((1..=n as u32).map(|i| sc.role_of(i)))
        .chain((1..sc.topology.routers.max(1)).map(|_| Role::Router))
        .collect();
    let net = SimNet::new(roles, link, root.split(1));
    net.set_joiners(sc.joiner_nodes());
    let hb = sc.heartbeat();
    // The Routers' bookkeeping checked after every input each handles, with
    // the schedulers' (`check_every_step`): the first break, with its time.
    let router_broken: Arc<Mutex<Option<(Duration, String)>>> = Arc::default();
    let router_check = sc.run.check_every_step.then(|| {
        let slot = router_broken.clone();
        let t0 = Instant::now();
        CheckHook(Arc::new(move |what: &str| {
            let at = Instant::now().saturating_duration_since(t0);
            lock(&slot).get_or_insert((at, what.to_string()));
        }))
    });
    let routers: Vec<RouterSlot> = sc
        .router_nodes()
        .into_iter()
        .map(|node| RouterSlot {
            node,
            engine: Mutex::new(None),
            life: Mutex::new(1),
        })
        .collect();
    let t0 = Instant::now();
    let world = Arc::new(World {
        sc: sc.clone(),
        net,
        placed: Mutex::new(vec![0; routers.len()]),
        cut_by_router: Mutex::new(0),
        routers,
        router_check,
        engines: Mutex::new((0..=n).map(|_| None).collect()),
        drains: Mutex::new((0..=n).map(|_| None).collect()),
        trace: Mutex::new(Trace {
            t0,
            hash: 0xcbf2_9ce4_8422_2325,
            events: 0,
            broken: None,
        }),
        outcomes: Mutex::new(Vec::new()),
        next_req: Mutex::new(0),
        t0,
        kv_samples: Mutex::new((0.0, 0)),
        sched,
        rng: root,
        decodes: Arc::new(DecodeLog::default()),
        cuts: Mutex::new(Cuts::default()),
        orphans: Mutex::new(0),
        stages: (0..=n)
            .map(|_| Arc::new(crate::exec::StageHealth::new(sc.stages())))
            .collect(),
        acceptance,
        single: fast.then(Arc::default),
    });
    for r in 0..world.routers.len() {
        start_router(&world, r, 1).await?;
    }
    // Joiners start when they join.
    for i in (1..=n as u32).filter(|&i| !world.sc.is_joiner(i)) {
        start_engine(&world, i, 1).await?;
    }
    // Every engine heard by the Router before traffic starts.
    tokio::time::sleep(hb * 3).await;
    let start = Instant::now();

    let mut tasks = JoinSet::new();
    let mut faults = world.sc.faults.clone();
    if let Some(c) = &world.sc.chaos {
        faults.extend(c.draw(&world.sc, &mut world.rng.split(2)));
    }
    // Fast mode goes step by step around every fault.
    let exact_spans = match &world.single {
        Some(_) => sc.exact_spans(&faults)?,
        None => Vec::new(),
    };
    let spans_task = world.single.clone().map(|flag| {
        let spans = exact_spans.clone();
        tokio::spawn(async move {
            use std::sync::atomic::Ordering;
            for (a, b) in spans {
                tokio::time::sleep_until(start + Duration::from_secs_f64(a)).await;
                flag.store(true, Ordering::Relaxed);
                if !b.is_finite() {
                    break;
                }
                tokio::time::sleep_until(start + Duration::from_secs_f64(b)).await;
                flag.store(false, Ordering::Relaxed);
            }
        })
    });
    for f in faults {
        let w = world.clone();
        tasks.spawn(async move {
            tokio::time::sleep_until(start + Duration::from_secs_f64(f.at_s)).await;
            apply_fault(&w, &f.kind).await;
        });
    }
    let end_of_arrivals = start + Duration::from_secs_f64(sc.run.duration_s);
    for (ti, t) in sc.traffic.iter().enumerate() {
        let mut rng = world.rng.split(1000 + ti as u64);
        match t.arrivals {
            Arrivals::Closed { clients, requests } => {
                let left = Arc::new(Mutex::new(requests.unwrap_or(usize::MAX)));
                for c in 0..clients {
                    let w = world.clone();
                    let left = left.clone();
                    let mut crng = rng.split(c as u64);
                    tasks.spawn(async move {
                        // Staggered starts, so the clients do not march in step.
                        let skew = Duration::from_secs_f64(crng.f64() * 0.1);
                        tokio::time::sleep(skew).await;
                        let mut j = 0u64;
                        while Instant::now() < end_of_arrivals {
                            {
                                let mut n = lock(&left);
                                if *n == 0 {
                                    break;
                                }
                                *n -= 1;
                            }
                            let key = request_key(ti, (c as u64) << 24 | j);
                            j += 1;
                            one_request(&w, ti, key, &mut crng, None).await;
                        }
                    });
                }
            }
            Arrivals::Poisson { rate_per_s } | Arrivals::Bursts { rate_per_s, .. } => {
                let mut at = Vec::new();
                let dur = sc.run.duration_s;
                if rate_per_s > 0.0 {
                    let mut t = rng.exp(1.0 / rate_per_s);
                    while t < dur {
                        at.push(t);
                        t += rng.exp(1.0 / rate_per_s);
                    }
                }
                if let Arrivals::Bursts { burst, every_s, .. } = t.arrivals {
                    let mut b = every_s;
                    while b < dur {
                        at.extend(std::iter::repeat_n(b, burst));
                        b += every_s;
                    }
                }
                at.sort_by(f64::total_cmp);
                let at: Vec<(f64, Option<(u32, u32)>)> =
                    at.into_iter().map(|a| (a, None)).collect();
                tasks.spawn(feed(world.clone(), ti, start, at, rng));
            }
            Arrivals::Trace {
                ref rows,
                speed,
                period_s,
                ..
            } => {
                // The trace looped until the arrivals stop.
                let dur = sc.run.duration_s;
                let mut at = Vec::new();
                'fill: for lap in 0u32.. {
                    if rows.is_empty() {
                        break;
                    }
                    for r in rows.iter() {
                        let a = (r.t + f64::from(lap) * period_s) / speed;
                        if a >= dur {
                            break 'fill;
                        }
                        at.push((a, Some((r.prompt_tokens, r.output_tokens))));
                    }
                }
                tasks.spawn(feed(world.clone(), ti, start, at, rng));
            }
        }
    }
    // KV accounting and queue caps, checked on every live engine as it runs.
    let sampler = {
        let w = world.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                check_engines(&w, false).await;
            }
        })
    };
    let deadline = end_of_arrivals + Duration::from_secs_f64(sc.run.drain_s);
    let drained = tokio::time::timeout_at(deadline, async {
        while let Some(r) = tasks.join_next().await {
            if let Err(e) = r {
                lock(&world.trace).violate(format!("a client task panicked: {e}"));
            }
        }
    })
    .await;
    sampler.abort();
    if let Some(t) = spans_task {
        t.abort();
    }
    if drained.is_err() {
        lock(&world.trace).violate(format!(
            "{} requests or faults still pending {} s after arrivals stopped",
            tasks.len(),
            sc.run.drain_s
        ));
    }
    let sim_s = Instant::now()
        .saturating_duration_since(start)
        .as_secs_f64();
    // Every block and seat back once the load is gone (load reports lag a
    // heartbeat, the engines answer at once).
    tokio::time::sleep(hb * 2).await;
    // The nodes as a Router that is up sees them (each Router's own
    // moves; the first one up speaks for the cluster's).
    let mut nodes = Vec::new();
    for (r, slot) in world.routers.iter().enumerate() {
        let engine = lock(&slot.engine).clone();
        if let Some(engine) = engine {
            let s = engine.status().await;
            lock(&world.placed)[r] += s.routing.placements;
            if nodes.is_empty() {
                nodes = s.nodes;
            }
        }
    }
    let moved: u64 = nodes.iter().map(|n| n.moved_away).sum();
    let moved_by_kv: u64 = nodes.iter().map(|n| n.moved_by_kv).sum();
    let kv_short: u64 = nodes.iter().map(|n| n.kv_short).sum();
    let node_lines: Vec<(String, bool, u64)> = nodes
        .iter()
        .map(|n| (n.name.clone(), n.up, n.routed))
        .collect();
    let (preemptions, offload) = check_engines(&world, true).await;
    check_single_dispatch(&world);
    let engines: Vec<LocalEngine> = lock(&world.engines).iter().flatten().cloned().collect();
    for e in engines {
        e.stop();
    }
    let trace = lock(&world.trace);
    if let Some((at_ms, what)) = trace.broken.clone() {
        return Err(SimError::Invariant { seed, at_ms, what });
    }
    if let Some((at, what)) = lock(&router_broken).clone() {
        return Err(SimError::Invariant {
            seed,
            at_ms: at.as_secs_f64() * 1e3,
            what,
        });
    }
    let faults = world.net.faults();
    if let Some(why) = world.net.refused_frame() {
        return Err(SimError::Invariant {
            seed,
            at_ms: sim_s * 1e3,
            what: format!(
                "{} frames refused by the codec or the role policy (a wire bug); the last: {why}",
                faults.frames_refused
            ),
        });
    }
    if let Some(what) = unfired(&world.sc, &faults) {
        return Err(SimError::Invariant {
            seed,
            at_ms: sim_s * 1e3,
            what,
        });
    }
    let down_after = hb * sc.cluster.down_after_missed;
    let (kv_sum, kv_n) = *lock(&world.kv_samples);
    let outcomes = lock(&world.outcomes).clone();
    Ok(Report {
        seed,
        tiers: tier_reports(&world.sc, &outcomes),
        tenants: tenant_reports(&world.sc, &outcomes),
        sim_s,
        output_tokens: outcomes
            .iter()
            .filter(|o| o.end == End::Finished)
            .map(|o| o.tokens)
            .sum(),
        kv_util: kv_sum / kv_n.max(1) as f64,
        preemptions,
        offload,
        faults,
        groups_formed_again: world.stages.iter().map(|h| h.formed_again()).sum(),
        orphans: *lock(&world.orphans),
        moved,
        moved_by_kv,
        kv_short,
        cut_by_router: *lock(&world.cut_by_router),
        placed_by_router: lock(&world.placed).clone(),
        pauses_ms: outcomes
            .iter()
            .filter(|o| o.gap_max > down_after)
            .map(|o| o.gap_max.as_secs_f64() * 1e3)
            .collect(),
        nodes: node_lines,
        move_pauses_ms: world
            .decodes
            .move_pauses()
            .iter()
            .map(|d| d.as_secs_f64() * 1e3)
            .collect(),
        requests: {
            let mut r: Vec<RequestRecord> = outcomes
                .iter()
                .map(|o| RequestRecord {
                    id: o.id,
                    key: o.key,
                    tier: o.tier,
                    end: o.end,
                    tokens: o.tokens,
                    sent: o.sent,
                    ttft: o.ttft,
                    tpot: o.tpot,
                    ended: o.ended,
                })
                .collect();
            r.sort_by_key(|r| r.key);
            r
        },
        exact_spans,
        events: trace.events,
        trace_hash: trace.hash,
    })
}

/// Starts Router `r` (an index into the scenario's Routers) in life `life`.
async fn start_router(w: &Arc<World>, r: usize, life: u64) -> Result<(), SimError> {
    let sc = &w.sc;
    let n = sc.engine_nodes() as u32;
    let node = w.routers[r].node;
    let net = w.net.clone();
    let connect: flotilla_cluster::Connect =
        Box::new(move |sink| Ok(net.join(node, life, sink) as Arc<dyn Transport>));
    let engine = ClusterEngine::start_with(
        connect,
        router_options(
            &sc.config,
            &sc.cluster,
            // The config's engines: joiners announce themselves.
            (1..=n)
                .filter(|&i| !sc.is_joiner(i))
                .map(|i| (i, format!("engine-{i}"), sc.role_of(i)))
                .collect(),
            sc.engine.block_size,
        ),
        RouterHooks {
            check: w.router_check.clone(),
            record: None,
        },
    )
    .await
    .map_err(SimError::Start)?;
    *lock(&w.routers[r].engine) = Some(engine);
    *lock(&w.routers[r].life) = life;
    Ok(())
}

/// Starts engine node `node`'s engine and bridge at `epoch`.
async fn start_engine(w: &Arc<World>, node: u32, life: u64) -> Result<(), SimError> {
    let e = &w.sc.engine;
    let shape = w.sc.model_shape()?;
    let vocab = shape.vocab;
    let model = shape.name.clone();
    let mut exec = SimExecutor::with_stages(
        w.sc.gpu_params()?,
        shape,
        e.block_size,
        e.max_num_batched_tokens,
        w.rng.split(100 + u64::from(node) * 1000 + life),
        w.sc.stages(),
    )
    .map_err(SimError::Start)?;
    if let Some(pipe) = w.sc.pipe_model()? {
        exec = exec.pipelined(pipe, w.stages[node as usize].clone());
    }
    if let Some(flag) = &w.single {
        exec = exec.single_steps_when(flag.clone());
    }
    // A decode node's draft model (a prefill node never drafts).
    let mut draft: Option<Box<dyn flotilla_exec::Executor>> = None;
    if let Some(d) = w.sc.draft_shape()?
        && w.sc.role_of(node) != Role::Prefill
    {
        exec = exec
            .with_draft(&d, w.acceptance.clone())
            .map_err(SimError::Start)?;
        let rng = w.rng.split(200 + u64::from(node) * 1000 + life);
        draft = Some(Box::new(
            SimExecutor::draft_for(&exec, d, rng).map_err(SimError::Start)?,
        ));
    }
    // A prefill node samples each request's first token too; only decoding
    // engines say where a request runs.
    if w.sc.run.check_every_step && w.sc.role_of(node) != Role::Prefill {
        exec = exec.with_tap(DecodeTap {
            log: w.decodes.clone(),
            node,
            t0: w.t0,
        });
    }
    // Weak: the engine lives inside the world.
    let weak = Arc::downgrade(w);
    let hook: InvariantHook = Arc::new(move |what| {
        if let Some(w) = weak.upgrade() {
            lock(&w.trace).violate(format!("engine-{node}: {what}"));
        }
    });
    // Nobody scrapes a simulated engine.
    let metrics = Arc::new(Metrics::disabled());
    let engine = spawn_engine(
        Box::new(exec),
        EngineOptions {
            sched: w.sched.clone(),
            check_invariants: w.sc.run.check_every_step.then_some(hook.clone()),
            constraints: Some(Arc::new(crate::exec::SimConstraints { vocab })),
            offload_path: None,
            tracing: None,
            draft,
        },
        Arc::new(SimClock(w.t0)),
        metrics,
    )
    .await
    .map_err(|e| SimError::Start(e.to_string()))?;
    let hb = w.sc.heartbeat();
    let role = w.sc.role_of(node);
    let settings = node_settings(
        &w.sc.config,
        &w.sc.cluster,
        w.sc.router_nodes(),
        role,
        &model,
    );
    let opts = WorkerOptions {
        on_orphan: Some(orphan_hook(w, hb)),
        // The node's protocol bookkeeping, checked with its scheduler's.
        check: w
            .sc
            .run
            .check_every_step
            .then(|| CheckHook(Arc::new(move |what: &str| hook(what.to_string())))),
        ..WorkerOptions::new(settings)
    };
    let epoch = (u64::from(node) << 32) | life;
    let node_net = w.net.clone();
    let connect: flotilla_cluster::Connect =
        Box::new(move |sink| Ok(node_net.join(node, epoch, sink) as Arc<dyn Transport>));
    let engine_arc = Arc::new(engine.clone());
    let kv: Option<Arc<dyn flotilla_engine::KvMigration>> = Some(engine_arc.clone() as _);
    let (drain_tx, drain_rx) = tokio::sync::watch::channel(None);
    let opts = WorkerOptions {
        drain: Some(drain_rx),
        ..opts
    };
    // Log lines of a replay (FLOTILLA_LOG) name the node.
    let span = tracing::info_span!("node", n = node, life);
    let weak = Arc::downgrade(w);
    let worker = async move {
        if run_worker(connect, engine_arc, kv, opts).await == Ok(WorkerEnd::Left)
            && let Some(w) = weak.upgrade()
        {
            // Drained: this life ends as a process would exit.
            w.net.leave(node, epoch);
            lock(&w.drains)[node as usize] = None;
            if let Some(e) = lock(&w.engines)[node as usize].take() {
                e.stop();
            }
        }
    };
    tokio::spawn(tracing::Instrument::instrument(worker, span));
    lock(&w.engines)[node as usize] = Some(engine);
    lock(&w.drains)[node as usize] = Some(drain_tx);
    Ok(())
}

/// An orphaned lease is expected only while a link is cut or soon after
/// (a held ack or cancel arrives late, and the hunt may come first: it
/// needs two looks and the Router its down bound). A crash or restart
/// does not excuse one: the protocol ends everything a dead node's peers
/// hold for it (abandon, cancel, epochs). Outside a cut's reach it is a
/// leak the protocol let through.
fn orphan_hook(w: &Arc<World>, hb: Duration) -> OrphanHook {
    let reach = hb * w.sc.cluster.down_after_missed * 6;
    let weak = Arc::downgrade(w);
    OrphanHook(Arc::new(move |what: &str| {
        let Some(w) = weak.upgrade() else {
            return;
        };
        let now = Instant::now().saturating_duration_since(w.t0);
        if excused(now, now, &lock(&w.cuts).windows, reach) {
            *lock(&w.orphans) += 1;
        } else {
            lock(&w.trace).violate(format!(
                "an orphaned lease with no link cut for {} ms: {what}",
                reach.as_millis()
            ));
        }
    }))
}

async fn apply_fault(w: &Arc<World>, f: &FaultKind) {
    tracing::info!("fault: {f:?}");
    match *f {
        FaultKind::RouterCrash { router } => {
            let slot = &w.routers[router];
            let engine = lock(&slot.engine).take();
            let Some(engine) = engine else {
                return;
            };
            // Its placements so far, before its counts die with it.
            let placed = engine.status().await.routing.placements;
            lock(&w.placed)[router] += placed;
            *lock(&slot.life) += 1;
            w.net.crash(slot.node);
            // The actor stops with its last handle: its clients' streams
            // break off.
            drop(engine);
        }
        FaultKind::RouterRestart { router } => {
            if lock(&w.routers[router].engine).is_some() {
                return;
            }
            let life = *lock(&w.routers[router].life);
            w.net.note_router_restart();
            if let Err(e) = start_router(w, router, life).await {
                lock(&w.trace).violate(format!("restarting router {router}: {e}"));
            }
        }
        FaultKind::Crash { node } => {
            w.net.crash(node);
            lock(&w.drains)[node as usize] = None;
            if let Some(e) = lock(&w.engines)[node as usize].take() {
                e.stop();
            }
        }
        FaultKind::Drain { node, grace_ms } => {
            if let Some(d) = &lock(&w.drains)[node as usize] {
                let _ = d.send(Some(Duration::from_millis(grace_ms)));
                w.net.note_drain();
            }
        }
        FaultKind::Restart { node } | FaultKind::Join { node } => {
            if lock(&w.engines)[node as usize].is_some() {
                return;
            }
            let join = matches!(f, FaultKind::Join { .. });
            if join {
                w.net.note_join();
            } else {
                w.net.note_restart();
            }
            // Lives are numbered across restarts and joins: each new one
            // is newer than any before it.
            let c = w.net.faults();
            let life = c.restarts + c.joins + 1;
            if let Err(e) = start_engine(w, node, life).await {
                let what = if join { "joining" } else { "restarting" };
                lock(&w.trace).violate(format!("{what} node {node}: {e}"));
            }
        }
        FaultKind::StageCrash { node, stage } => {
            if w.stages[node as usize].set_down(stage, true) {
                w.net.note_stage_crash();
            }
        }
        FaultKind::StageRestart { node, stage } => {
            if w.stages[node as usize].set_down(stage, false) {
                w.net.note_stage_restart();
            }
        }
        FaultKind::Partition { a, b, one_way } => {
            cut(w, Cut::Partition, true);
            w.net.partition(a, b, !one_way);
        }
        FaultKind::Heal => {
            w.net.heal();
            cut(w, Cut::Partition, false);
        }
        FaultKind::Clog { a, b } => {
            cut(w, Cut::Clog, true);
            w.net.clog(a, b);
        }
        FaultKind::Unclog => {
            // One link at a time, in a random order (swizzle-clog).
            for (a, b) in w.net.clogged_in_random_order() {
                w.net.unclog(a, b);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            cut(w, Cut::Clog, false);
        }
    }
}

/// Whether two engines decoding one request from `from` to `to` is the
/// expected overlap of a cut link: it began after a cut (less the span
/// resolution) and ended within `grace` of that cut's healing.
fn excused(
    from: Duration,
    to: Duration,
    cuts: &[(Duration, Option<Duration>)],
    grace: Duration,
) -> bool {
    cuts.iter().any(|&(start, end)| {
        let until = end.map_or(Duration::MAX, |e| e + grace);
        from + DecodeLog::GAP >= start && to <= until
    })
}

/// Links cut by partitions and clogs: the windows during which some link
/// was cut (start, end since the run's start; no end while one still is).
#[derive(Default)]
struct Cuts {
    windows: Vec<(Duration, Option<Duration>)>,
    partitioned: bool,
    clogged: bool,
}

#[derive(Clone, Copy)]
enum Cut {
    Partition,
    Clog,
}

impl Cuts {
    /// A partition or clog begins (`true`) or all of that kind end; a
    /// window lasts while either kind holds a link.
    fn note(&mut self, kind: Cut, begins: bool, now: Duration) {
        let was = self.partitioned || self.clogged;
        match kind {
            Cut::Partition => self.partitioned = begins,
            Cut::Clog => self.clogged = begins,
        }
        let is = self.partitioned || self.clogged;
        if is && !was {
            self.windows.push((now, None));
        } else if was
            && !is
            && let Some((_, end @ None)) = self.windows.last_mut()
        {
            *end = Some(now);
        }
    }
}

fn cut(w: &World, kind: Cut, begins: bool) {
    let now = Instant::now().saturating_duration_since(w.t0);
    lock(&w.cuts).note(kind, begins, now);
}

/// No request decodes on two engines at once, except while a link is cut
/// and until the Router and the engines have noticed it healed: a Router
/// that re-ran a request elsewhere must stop the first copy (the engine
/// drops a silent Router's requests; the Router cancels work it no longer
/// wants when that work's tokens reach it), not let both run on.
fn check_single_dispatch(w: &World) {
    let hb = w.sc.heartbeat();
    let grace = hb * (w.sc.cluster.down_after_missed + 2);
    let cuts = lock(&w.cuts).windows.clone();
    for (req, a, b) in w.decodes.overlaps() {
        let (from, to) = (a.first.max(b.first), a.last.min(b.last));
        if !excused(from, to, &cuts, grace) {
            lock(&w.trace).violate(format!(
                "request {req} decoded on engine-{} and engine-{} at once, from {:.0} to {:.0} ms                  (dispatched twice, and not while a link was cut or within {} ms of its healing)",
                a.node,
                b.node,
                from.as_secs_f64() * 1e3,
                to.as_secs_f64() * 1e3,
                grace.as_millis()
            ));
        }
    }
}

/// A scheduled or enabled fault that never fired.
fn unfired(sc: &Scenario, f: &FaultCounts) -> Option<String> {
    let mut missing = Vec::new();
    let net = &sc.network;
    for (rate, fired, name) in [
        (net.loss, f.lost, "loss"),
        (net.duplicate, f.duplicated, "duplicate"),
        (net.reorder, f.reordered, "reorder"),
    ] {
        // A per-message fault may miss a short run by chance: only a run
        // where it was expected at least 21 times (never firing has odds
        // under 1e-9) must have seen it. Swarms check the rest in total.
        let expected = rate * f.messages as f64;
        if expected >= 21.0 && fired == 0 {
            missing.push(name);
        }
    }
    for x in &sc.faults {
        let (fired, name) = match x.kind {
            FaultKind::Crash { .. } => (f.crashes, "crash"),
            FaultKind::RouterCrash { .. } => (f.router_crashes, "router_crash"),
            FaultKind::RouterRestart { .. } => (f.router_restarts, "router_restart"),
            FaultKind::Restart { .. } => (f.restarts, "restart"),
            FaultKind::Join { .. } => (f.joins, "join"),
            FaultKind::StageCrash { .. } => (f.stage_crashes, "stage_crash"),
            FaultKind::StageRestart { .. } => (f.stage_restarts, "stage_restart"),
            // Started, and ended with the node leaving.
            FaultKind::Drain { .. } => (f.drains.min(f.drained), "drain"),
            FaultKind::Partition { .. } => (f.partitioned, "partition"),
            FaultKind::Clog { .. } => (f.clogged, "clog"),
            FaultKind::Heal | FaultKind::Unclog => continue,
        };
        if fired == 0 && !missing.contains(&name) {
            missing.push(name);
        }
    }
    (!missing.is_empty()).then(|| {
        format!(
            "enabled faults that never fired: {} (the scenario does not test them)",
            missing.join(", ")
        )
    })
}

/// Draws a length.
fn draw(l: &Lengths, rng: &mut Rng) -> u32 {
    match *l {
        Lengths::Fixed { tokens } => tokens,
        Lengths::Uniform { min, max } => rng.range(u64::from(min), u64::from(max)) as u32,
        Lengths::Lognormal {
            mu,
            sigma,
            min,
            max,
        } => (rng.lognormal(mu, sigma).round() as u32).clamp(min, max),
    }
}

/// One tenant's open arrivals: request `k` starts at `at[k]` (seconds from
/// `start`; with its lengths where a trace gives them), each its own task,
/// spawned when it arrives (so a long run holds only the requests in
/// flight). Ends when every one has ended.
async fn feed(
    w: Arc<World>,
    ti: usize,
    start: Instant,
    at: Vec<(f64, Option<(u32, u32)>)>,
    rng: Rng,
) {
    let mut live = JoinSet::new();
    for (k, (a, lengths)) in at.into_iter().enumerate() {
        let mut rrng = rng.split(k as u64);
        tokio::time::sleep_until(start + Duration::from_secs_f64(a)).await;
        let client = w.clone();
        live.spawn(async move {
            one_request(&client, ti, request_key(ti, k as u64), &mut rrng, lengths).await;
        });
        while let Some(done) = live.try_join_next() {
            if let Err(e) = done {
                lock(&w.trace).violate(format!("a client task panicked: {e}"));
            }
        }
    }
    while let Some(done) = live.join_next().await {
        if let Err(e) = done {
            lock(&w.trace).violate(format!("a client task panicked: {e}"));
        }
    }
}

/// One client request: submit through the Router, read the stream, check
/// it, record it.
/// A request's key: its tenant and its place in that tenant's traffic
/// (the arrival's index; a closed client's index and its request's), the
/// same whatever the timing.
fn request_key(tenant: usize, n: u64) -> u64 {
    (tenant as u64) << 48 | (n & ((1 << 48) - 1))
}

async fn one_request(
    w: &Arc<World>,
    tenant: usize,
    key: u64,
    rng: &mut Rng,
    lengths: Option<(u32, u32)>,
) {
    let t = &w.sc.traffic[tenant];
    let tier = w.sc.tier_of(tenant);
    let (prompt_len, output_len) = match lengths {
        Some(l) => l,
        None => {
            let p = draw(&t.prompt, rng);
            (p, draw(&t.output, rng))
        }
    };
    let max_len = w.sc.max_model_len as u32;
    let max_tokens = output_len.min(max_len.saturating_sub(prompt_len).max(1));
    let cancel_after = rng
        .chance(t.cancel_fraction)
        .then(|| rng.range(1, u64::from(max_tokens)));
    let constraint = rng
        .chance(t.constrained_fraction)
        .then_some(flotilla_exec::Constraint::JsonObject);
    let prompt: Vec<u32> = (0..prompt_len)
        .map(|_| rng.range(3, 30_000) as u32)
        .collect();
    let id = {
        let mut n = lock(&w.next_req);
        *n += 1;
        *n
    };
    lock(&w.trace).record(id, SUBMIT, u64::from(prompt_len));
    w.acceptance.set(id, t.draft_acceptance);
    tracing::debug!(req = id, prompt_len, max_tokens, "client: submit");
    let sent = Instant::now();
    let req = EngineRequest {
        tenant: TenantId(tenant as u32),
        prompt,
        max_tokens,
        sampling: SamplingParams {
            seed: id,
            ..SamplingParams::greedy()
        },
        logit_bias: Vec::new(),
        generated: 0,
        constraint,
        ignore_eos: true,
        // Fast mode: a client that will cancel watches each token, so its
        // request's engine plans one step at a time while it runs (a
        // stop token the simulated model never draws: ids 0..3 never are),
        // and the cancel comes when the exact mode's would.
        stop_token_ids: if cancel_after.is_some() && w.single.is_some() {
            vec![0]
        } else {
            Vec::new()
        },
        speculative: true,
        trace: None,
    };
    let mut out = Outcome {
        id,
        key,
        sent: sent.saturating_duration_since(w.t0),
        ended: sent.saturating_duration_since(w.t0),
        tier,
        tenant,
        end: End::Refused,
        ttft: None,
        tpot: None,
        tokens: 0,
        gap_max: Duration::ZERO,
    };
    // The Routers that are up take clients in turn (a load balancer's
    // round robin); with none up the client is refused, as by a front
    // with no backend.
    let up: Vec<(usize, ClusterEngine, u64)> = w
        .routers
        .iter()
        .enumerate()
        .filter_map(|(r, slot)| {
            let e = lock(&slot.engine).clone()?;
            Some((r, e, *lock(&slot.life)))
        })
        .collect();
    if up.is_empty() {
        lock(&w.trace).record(id, REFUSED, 503);
        out.ended = Instant::now().saturating_duration_since(w.t0);
        lock(&w.outcomes).push(out);
        return;
    }
    let (router, engine, life) = up[(id as usize) % up.len()].clone();
    drop(up);
    let submitted = engine.submit(req).await;
    // The client holds no Router: a crash stops it.
    drop(engine);
    let mut stream = match submitted {
        Ok(s) => s,
        Err(r) => {
            let code = match r {
                Rejection::TenantLimit { .. } => 429,
                Rejection::TooLong { .. } | Rejection::Invalid(_) => 400,
                Rejection::QueueFull { .. } | Rejection::Unavailable => 503,
            };
            lock(&w.trace).record(id, REFUSED, code);
            out.ended = Instant::now().saturating_duration_since(w.t0);
            lock(&w.outcomes).push(out);
            return;
        }
    };
    let (mut first, mut last) = (None, None);
    // Events come as the Router hands them on (a node message's worth for
    // this request): the tokens of a batch arrive together.
    let mut batch = std::vec::IntoIter::default();
    loop {
        let ev = match batch.next() {
            Some(ev) => Some(ev),
            None => match stream.recv_chunk().await {
                Some(StreamChunk::One(ev)) => Some(ev),
                Some(StreamChunk::Many(b)) => {
                    batch = b.into_iter();
                    batch.next()
                }
                None => None,
            },
        };
        let now = Instant::now();
        match ev {
            Some(EngineEvent::Token(s)) => {
                out.tokens += 1;
                first.get_or_insert(now);
                if let Some(l) = last {
                    out.gap_max = out.gap_max.max(now - l);
                }
                last = Some(now);
                let mut trace = lock(&w.trace);
                trace.record(id, TOKEN, u64::from(s.token));
                if out.tokens > u64::from(max_tokens) {
                    trace.violate(format!(
                        "request {id}: token {} beyond max_tokens {max_tokens} (a duplicate)",
                        out.tokens
                    ));
                }
                if cancel_after == Some(out.tokens) {
                    trace.record(id, CANCELLED, out.tokens);
                    drop(trace);
                    drop(stream);
                    out.end = End::Cancelled;
                    break;
                }
            }
            Some(EngineEvent::Finished { reason, usage }) => {
                out.end = End::Finished;
                lock(&w.trace).record(id, FINISHED, u64::from(usage.completion_tokens));
                let whole = reason == FinishReason::Length && out.tokens == u64::from(max_tokens);
                if u64::from(usage.completion_tokens) != out.tokens || !whole {
                    lock(&w.trace).violate(format!(
                        "request {id}: finished ({reason:?}) with {} tokens streamed, usage says {}, \
                         max_tokens {max_tokens} (a gap or a duplicate)",
                        out.tokens, usage.completion_tokens
                    ));
                }
                break;
            }
            Some(EngineEvent::Failed(f)) => {
                out.end = End::Failed;
                tracing::debug!(req = id, "client: failed after {} tokens: {f}", out.tokens);
                let code = match f {
                    EngineFailure::QueueTimeout { .. } => 1,
                    EngineFailure::KvTransfer(_) => 2,
                    _ => 0,
                };
                lock(&w.trace).record(id, FAILED, code);
                break;
            }
            None if *lock(&w.routers[router].life) != life => {
                // Its Router died: the client sees a broken connection.
                out.end = End::Failed;
                *lock(&w.cut_by_router) += 1;
                lock(&w.trace).record(id, FAILED, 3);
                break;
            }
            None => {
                lock(&w.trace).violate(format!(
                    "request {id}: the stream ended after {} tokens with no terminal event",
                    out.tokens
                ));
                out.end = End::Failed;
                break;
            }
        }
    }
    tracing::debug!(req = id, tokens = out.tokens, "client: {:?}", out.end);
    if let (Some(f), Some(l)) = (first, last) {
        out.ttft = Some(f - sent);
        if out.tokens > 1 {
            out.tpot = Some((l - f) / (out.tokens as u32 - 1));
        }
    }
    out.ended = Instant::now().saturating_duration_since(w.t0);
    lock(&w.outcomes).push(out);
}

/// Checks every live engine: KV accounting adds up, queues within their
/// caps; at the end also nothing leased, queued or running. Returns the
/// engines' preemptions and offload tiers.
async fn check_engines(w: &Arc<World>, at_end: bool) -> (u64, flotilla_proto::KvOffload) {
    let engines: Vec<(usize, LocalEngine)> = lock(&w.engines)
        .iter()
        .enumerate()
        .filter_map(|(i, e)| e.clone().map(|e| (i, e)))
        .collect();
    let mut preemptions = 0;
    let mut offload = flotilla_proto::KvOffload::default();
    for (i, e) in engines {
        let s = e.status().await;
        let kv = s.kv;
        preemptions += s.preemptions;
        offload = offload.plus(&kv.offload);
        let mut broken = Vec::new();
        if u64::from(kv.free) + u64::from(kv.used) + u64::from(kv.cached) != u64::from(kv.total)
            && kv.total > 0
        {
            broken.push(format!(
                "KV accounting: free {} + used {} + cached {} != total {}",
                kv.free, kv.used, kv.cached, kv.total
            ));
        }
        // Admission refuses at the cap; requests preempted back into the
        // queue (at most a batch of them) may stand beyond it.
        let seats = w.sc.engine.max_num_seqs;
        for (t, cfg) in s.tiers.iter().zip(&w.sc.config.tiers) {
            if t.queued > cfg.queue_len_max + seats {
                broken.push(format!(
                    "tier {} queue {} over its cap {} plus {seats} preempted",
                    t.name, t.queued, cfg.queue_len_max
                ));
            }
        }
        if at_end {
            let queued: usize = s.tiers.iter().map(|t| t.queued).sum();
            if kv.used != 0 || s.running != 0 || queued != 0 {
                broken.push(format!(
                    "after the run: {} KV blocks leased ({} held for a transfer, {} reserved \
                     for an import), {} running, {queued} queued (a leak)",
                    kv.used, kv.held, kv.reserved, s.running
                ));
            }
        } else if kv.total > 0 {
            let mut k = lock(&w.kv_samples);
            k.0 += f64::from(kv.used) / f64::from(kv.total);
            k.1 += 1;
        }
        if kv.offload.held > kv.offload.total
            || kv
                .offload
                .spilled
                .checked_sub(kv.offload.restored + kv.offload.dropped)
                != Some(u64::from(kv.offload.held))
        {
            broken.push(format!("KV offload accounting: {:?}", kv.offload));
        }
        for b in broken {
            lock(&w.trace).violate(format!("engine-{i}: {b}"));
        }
    }
    (preemptions, offload)
}

/// The `p`th percentile (0..=100) of `v`, nearest rank; 0 for none.
pub(crate) fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let i = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
    v[i]
}

fn tenant_reports(sc: &Scenario, outcomes: &[Outcome]) -> Vec<TenantReport> {
    sc.config
        .tenants
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let mine = || outcomes.iter().filter(move |o| o.tenant == i);
            let count = |e: End| mine().filter(|o| o.end == e).count() as u64;
            TenantReport {
                name: t.name.clone(),
                tier: sc.config.tiers[t.tier].name.clone(),
                weight: t.weight,
                sent: mine().count() as u64,
                finished: count(End::Finished),
                refused: count(End::Refused),
                output_tokens: mine().map(|o| o.tokens).sum(),
            }
        })
        .collect()
}

fn tier_reports(sc: &Scenario, outcomes: &[Outcome]) -> Vec<TierReport> {
    sc.config
        .tiers
        .iter()
        .zip(&sc.slos)
        .enumerate()
        .map(|(i, (t, slo))| {
            let mine: Vec<&Outcome> = outcomes.iter().filter(|o| o.tier == i).collect();
            let count = |e: End| mine.iter().filter(|o| o.end == e).count() as u64;
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            let done: Vec<&&Outcome> = mine.iter().filter(|o| o.end == End::Finished).collect();
            let mut ttft: Vec<f64> = done.iter().filter_map(|o| o.ttft.map(ms)).collect();
            let mut tpot: Vec<f64> = done.iter().filter_map(|o| o.tpot.map(ms)).collect();
            let within = done
                .iter()
                .filter(|o| {
                    o.ttft.is_some_and(|d| ms(d) <= slo.ttft_ms)
                        && o.tpot.is_none_or(|d| ms(d) <= slo.tpot_ms)
                })
                .count() as u64;
            TierReport {
                name: t.name.clone(),
                sent: mine.len() as u64,
                finished: count(End::Finished),
                refused: count(End::Refused),
                failed: count(End::Failed),
                cancelled: count(End::Cancelled),
                within_slo: within,
                ttft_ms: (percentile(&mut ttft, 50.0), percentile(&mut ttft, 99.0)),
                tpot_ms: (percentile(&mut tpot, 50.0), percentile(&mut tpot, 99.0)),
                weight: t.weight,
                kv_reserved_blocks: t.kv_reserved_blocks,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn a_cut_window_lasts_while_a_partition_or_a_clog_holds_a_link() {
        let mut c = Cuts::default();
        c.note(Cut::Partition, true, ms(10));
        c.note(Cut::Clog, true, ms(20));
        // The partition heals, the clog holds: still cut.
        c.note(Cut::Partition, false, ms(30));
        assert_eq!(c.windows, [(ms(10), None)]);
        c.note(Cut::Clog, false, ms(40));
        assert_eq!(c.windows, [(ms(10), Some(ms(40)))]);
        // A heal with nothing cut opens nothing.
        c.note(Cut::Partition, false, ms(50));
        c.note(Cut::Clog, true, ms(60));
        c.note(Cut::Clog, false, ms(70));
        assert_eq!(c.windows, [(ms(10), Some(ms(40))), (ms(60), Some(ms(70)))]);
    }

    #[test]
    fn two_engines_at_once_are_excused_only_inside_a_cut_and_its_grace() {
        let grace = ms(1000);
        let cuts = [(ms(10_000), Some(ms(20_000))), (ms(50_000), None)];
        // During the first cut, ending within the grace after it healed.
        assert!(excused(ms(12_000), ms(20_900), &cuts, grace));
        // Running on past the grace: the first copy was never stopped.
        assert!(!excused(ms(12_000), ms(21_500), &cuts, grace));
        // With no cut at all.
        assert!(!excused(ms(30_000), ms(31_000), &cuts, grace));
        // A cut not yet healed when the run ended excuses to the end.
        assert!(excused(ms(55_000), ms(90_000), &cuts, grace));
        // No cuts, nothing excused.
        assert!(!excused(ms(1), ms(2), &[], grace));
    }
}
