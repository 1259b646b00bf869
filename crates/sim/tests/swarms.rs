//! Seed swarms of every fault scenario (a bounded one here; the long one
//! is tests/sim/swarm.sh), and every seed that ever failed, kept.

use flotilla_sim::{Scenario, SwarmReport, run, swarm};

fn shipped(name: &str) -> Scenario {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../simulations")
        .join(name);
    Scenario::load(&p).unwrap_or_else(|e| panic!("{e}"))
}

fn jobs() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// Seeds per scenario in CI: enough to find what two seeds missed (the
/// P/D leak broke 6 of 100), small enough for a few minutes in all.
const CI_SEEDS: u64 = 128;

fn assert_no_failures(name: &str, s: &SwarmReport) {
    let failed: Vec<String> = s
        .failures()
        .map(|r| format!("seed {}: {}", r.seed, r.result.as_ref().unwrap_err()))
        .collect();
    assert!(
        failed.is_empty(),
        "{name}: {} of {} seeds failed:\n{}",
        failed.len(),
        s.seeds.len(),
        failed.join("\n")
    );
}

fn swarm_of(name: &str, first: u64) -> SwarmReport {
    let sc = shipped(name);
    let s = swarm(&sc, first, CI_SEEDS, jobs(), &|_| {});
    assert_eq!(s.seeds.len() as u64, CI_SEEDS);
    assert_no_failures(name, &s);
    s
}

#[test]
fn a_swarm_of_the_fault_storm_holds() {
    swarm_of("fault-storm.toml", 1000);
}

#[test]
fn a_swarm_of_the_disaggregated_fault_storm_holds() {
    let s = swarm_of("pd-fault-storm.toml", 1000);
    // The scheduled faults fired in every seed.
    for r in &s.seeds {
        let f = r.result.as_ref().unwrap().faults;
        assert!(f.crashes == 2 && f.restarts == 1, "seed {}: {f:?}", r.seed);
    }
}

/// A rolling restart (each engine node drained, then restarted) costs no
/// request in any seed: none fails or is refused, every drain ends with
/// the node leaving, and what ran past a grace period moved.
fn assert_rolling_drain(name: &str) {
    let s = swarm_of(name, 1);
    for r in &s.seeds {
        let f = r.result.as_ref().unwrap().faults;
        assert!(
            f.drains == 4 && f.drained == 4 && f.restarts == 4,
            "seed {}: {f:?}",
            r.seed
        );
    }
    let t = s.totals();
    assert_eq!((t.failed, t.refused), (0, 0), "{name}: {t:?}");
    assert!(t.finished > 0 && t.moved > 0, "{name}: {t:?}");
}

#[test]
fn a_swarm_of_rolling_drains_loses_no_request() {
    assert_rolling_drain("rolling-drain.toml");
}

#[test]
fn a_swarm_of_disaggregated_rolling_drains_loses_no_request() {
    assert_rolling_drain("pd-rolling-drain.toml");
}

/// A decode node killed under 16 streams with a fifth of the clients
/// cancelling: nothing is refused or fails while the other nodes have room.
#[test]
fn a_swarm_of_a_decode_node_killed_under_cancelling_clients_refuses_nothing() {
    let s = swarm_of("pd-kill-cancel.toml", 1);
    let mut hung = 0;
    for r in &s.seeds {
        let f = r.result.as_ref().unwrap().faults;
        assert_eq!(f.crashes, 1, "seed {}: {f:?}", r.seed);
        hung += f.transfers_hung;
    }
    // KV transfers to the dead node hung until the idle timeout (as over
    // QUIC) in some seeds, and cost nothing either.
    assert!(hung > 0, "no transfer hung");
    let t = s.totals();
    assert_eq!((t.failed, t.refused), (0, 0), "{t:?}");
    assert!(t.cancelled > 0 && t.moved > 0, "{t:?}");
}

/// Issue 21's 503 burst: the same kill on nodes with 200 KV blocks each,
/// so the decode node left is often short of blocks for a reservation
/// (counted: the fault fired). It queues those requests whole instead of
/// the Router answering 503, and a request queued there beside the
/// reservations waits for their blocks instead of failing as too large.
#[test]
fn a_swarm_of_a_decode_node_killed_with_small_kv_pools_refuses_nothing() {
    let s = swarm_of("pd-kill-cancel-small-kv.toml", 1);
    for r in &s.seeds {
        let f = r.result.as_ref().unwrap().faults;
        assert_eq!(f.crashes, 1, "seed {}: {f:?}", r.seed);
    }
    let t = s.totals();
    assert!(t.kv_short > 0, "no decode node was short of blocks: {t:?}");
    assert_eq!((t.failed, t.refused), (0, 0), "{t:?}");
    assert!(t.cancelled > 0 && t.moved > 0, "{t:?}");
}

/// Faults drawn by the seed fire: crashes, restarts, partitions and
/// clogs all happened across the swarm, in different places per seed.
fn assert_chaos_fired(s: &SwarmReport) {
    let (mut crashes, mut restarts, mut partitioned, mut clogged) = (0, 0, 0, 0);
    let mut hashes = std::collections::BTreeSet::new();
    for r in &s.seeds {
        let rep = r.result.as_ref().unwrap();
        crashes += rep.faults.crashes;
        restarts += rep.faults.restarts;
        partitioned += rep.faults.partitioned;
        clogged += rep.faults.clogged;
        hashes.insert(rep.trace_hash);
    }
    let n = s.seeds.len() as u64;
    // Three crashes are drawn per seed (fewer when only the last node of
    // a role is up), three in four restart.
    assert!(crashes >= 2 * n, "{crashes} crashes over {n} seeds");
    assert!(restarts >= n, "{restarts} restarts over {n} seeds");
    assert!(partitioned > n, "{partitioned} messages held by partitions");
    assert!(clogged > n, "{clogged} messages held by clogs");
    assert_eq!(hashes.len() as u64, n, "two seeds ran the same trace");
}

#[test]
fn a_swarm_of_the_chaos_storm_holds() {
    let s = swarm_of("chaos-storm.toml", 1);
    assert_chaos_fired(&s);
}

#[test]
fn a_swarm_of_the_disaggregated_chaos_storm_holds() {
    let s = swarm_of("pd-chaos-storm.toml", 1);
    assert_chaos_fired(&s);
}

/// The chaos storms with multi-step decode plans (`[engine]
/// decode_steps`): a plan cut by whatever its engine is told (a request,
/// a cancel, a move, KV) among crashes, partitions and clogs.
#[test]
fn swarms_of_the_chaos_storms_with_multi_step_decode_hold() {
    for name in ["chaos-storm.toml", "pd-chaos-storm.toml"] {
        let mut sc = shipped(name);
        let one = run(&sc, 3).unwrap().trace_hash;
        sc.engine.decode_steps = 8;
        let s = swarm(&sc, 2000, CI_SEEDS, jobs(), &|_| {});
        assert_no_failures(name, &s);
        assert_chaos_fired(&s);
        // The setting changed what ran.
        assert_ne!(
            run(&sc, 3).unwrap().trace_hash,
            one,
            "{name}: no plan held several steps"
        );
    }
}

/// The chaos storms with a draft model on every decoding engine (a 1B
/// beside the 8B; a prefill node holds none): drafts filled, verified and
/// given back among crashes, partitions, clogs, P/D transfers and moves,
/// every invariant held (no block leaked, no request answered twice).
#[test]
fn swarms_of_the_chaos_storms_with_a_draft_model_hold() {
    for name in ["chaos-storm.toml", "pd-chaos-storm.toml"] {
        let mut sc = shipped(name);
        let one = run(&sc, 3).unwrap().trace_hash;
        let max_draft = 4;
        sc.engine.speculation = flotilla_sched::Speculation::draft_model(max_draft);
        sc.engine.draft_model = Some("llama3-1b".into());
        let s = swarm(&sc, 3000, CI_SEEDS / 2, jobs(), &|_| {});
        assert_no_failures(name, &s);
        assert_chaos_fired(&s);
        assert_ne!(
            run(&sc, 3).unwrap().trace_hash,
            one,
            "{name}: the draft model changed nothing"
        );
    }
}

/// Pipeline groups under drawn faults: stage crashes fired, groups formed
/// again, and no stream failed (two other groups had room) in any seed.
#[test]
fn a_swarm_of_the_pipeline_storm_holds() {
    let s = swarm_of("pipeline-storm.toml", 1);
    let (mut stage_crashes, mut formed) = (0, 0);
    for r in &s.seeds {
        let rep = r.result.as_ref().unwrap();
        stage_crashes += rep.faults.stage_crashes;
        formed += rep.groups_formed_again;
    }
    let n = s.seeds.len() as u64;
    assert!(
        stage_crashes >= 2 * n,
        "{stage_crashes} stage crashes over {n} seeds"
    );
    assert!(
        formed >= n,
        "groups formed again {formed} times over {n} seeds"
    );
    let t = s.totals();
    assert!(t.finished > 0 && t.moved > 0, "{t:?}");
}

/// Seeds that once broke an invariant, each with what it found.
#[test]
fn every_seed_that_ever_failed_holds() {
    let kept: &[(&str, &[u64])] = &[
        // A decode node died after its KV arrived and before it acked:
        // the prefill node held the blocks to the 30 s hold deadline.
        ("pd-fault-storm.toml", &[4, 11, 35, 38, 45, 91]),
        // Not a cluster bug: loss at 1e-3 per message did not fire in a
        // run where it was expected ~10 times, and the per-seed "enabled
        // fault never fired" check called that a failure.
        ("pd-fault-storm.toml", &[748]),
        // An engine dropped a Router's requests when only Router -> engine
        // was cut, and the Router waited for them forever.
        ("chaos-storm.toml", &[2, 12, 15, 18, 21]),
        // Not a cluster bug: a request moved off an engine and back to it
        // within a second looked, to the decode log, like one span on that
        // engine overlapping the other engine's.
        ("chaos-storm.toml", &[178]),
        // The same on decode nodes (hangs), a re-run placed on the same
        // decode node whose reservation the first placement's import
        // ended (kept forever), and a decode node that only seemed lost
        // keeping its reservations.
        (
            "pd-chaos-storm.toml",
            &[10, 29, 40, 44, 77, 172, 183, 185, 194],
        ),
        // A Submit held on a cut link reached its engine after the link
        // healed, when the Router (which had run it elsewhere, its Cancel
        // refused while the engine was unreachable) no longer wanted it:
        // two engines decoded it past the heal window.
        ("chaos-storm.toml", &[1855]),
        // Found on the way to the fix above (this seed passed before it by
        // its timing): the Router's answer about an engine's earlier
        // placement of a request ended the later one placed there.
        ("pd-chaos-storm.toml", &[1740]),
    ];
    for (name, seeds) in kept {
        let sc = shipped(name);
        for &seed in *seeds {
            if let Err(e) = run(&sc, seed) {
                panic!("{name} seed {seed}: {e}");
            }
        }
    }
}

#[test]
fn a_swarm_gives_each_seed_the_trace_it_gives_alone() {
    let sc = shipped("pd-chaos-storm.toml");
    let s = swarm(&sc, 500, 4, 2, &|_| {});
    for r in &s.seeds {
        let alone = run(&sc, r.seed).unwrap();
        assert_eq!(r.result.as_ref().unwrap().trace_hash, alone.trace_hash);
    }
}

#[test]
fn a_swarm_reports_every_failing_seed_not_only_the_first() {
    // Requests that cannot end within the drain: every seed fails.
    let mut sc = shipped("chaos-storm.toml");
    sc.run.duration_s = 2.0;
    sc.run.drain_s = 0.001;
    sc.chaos = None;
    let s = swarm(&sc, 1, 3, 2, &|_| {});
    let failed: Vec<u64> = s.failures().map(|r| r.seed).collect();
    assert_eq!(failed, [1, 2, 3]);
}

/// The KV offload tier under faults (crash and restart, partition, a lossy
/// network, cancellations) while preemption sends streams through it:
/// every invariant holds in every seed, the engines' tier accounting
/// included, and the tier did its work (blocks restored in every seed).
#[test]
fn a_swarm_of_the_offload_tier_under_faults_holds() {
    let s = swarm_of("kv-offload-faults.toml", 1000);
    for r in &s.seeds {
        let r = r.result.as_ref().unwrap();
        assert!(r.faults.crashes == 1 && r.faults.restarts == 1, "{r}");
        assert!(r.preemptions > 0 && r.offload.restored > 0, "{r}");
    }
}

/// Two Routers among engine crashes, partitions and clogs, Routers
/// crashing and coming back, a node in no config joining, leaving and
/// joining again: every invariant held in every seed (no block
/// leaked on any engine, no request answered twice, every stream ended
/// once: whole, refused, failed, or cut with its Router), and the storm
/// did what it says.
#[test]
fn a_swarm_of_the_router_storm_holds() {
    let s = swarm_of("router-storm.toml", 1);
    let n = s.seeds.len() as u64;
    let (mut router_crashes, mut router_restarts, mut cut, mut crashes) = (0, 0, 0, 0);
    let (mut joins, mut left, mut joined_placed) = (0, 0, 0);
    let mut both_placed = 0;
    for r in &s.seeds {
        let rep = r.result.as_ref().unwrap();
        router_crashes += rep.faults.router_crashes;
        router_restarts += rep.faults.router_restarts;
        crashes += rep.faults.crashes;
        cut += rep.cut_by_router;
        both_placed += u64::from(rep.placed_by_router.iter().all(|&p| p > 0));
        joins += rep.faults.joins;
        left += rep.faults.drained;
        // The joiner took work in the seeds where the Routers still know
        // it at the end.
        joined_placed += rep
            .nodes
            .iter()
            .filter(|n| n.0 == "engine-4" && n.2 > 0)
            .count() as u64;
    }
    eprintln!(
        "router storm, {n} seeds: {router_crashes} Router crashes, {router_restarts} restarts, \
         {crashes} engine crashes, {cut} streams cut with their Router; {joins} joins of a node \
         in no config, {left} drained and left, the joiner placed on in {joined_placed} of the \
         seeds that ended with it known"
    );
    // The joiner joins in every seed (its first join always finds it out),
    // and the drawn leaves happen.
    assert!(joins >= n, "{joins} joins over {n} seeds");
    assert!(left >= n / 4, "{left} leaves over {n} seeds");
    assert!(
        joined_placed >= n / 4,
        "{joined_placed} seeds placed on the joiner"
    );
    // Three Router crashes are drawn per seed (fewer when the other is
    // down then); each comes back.
    assert!(
        router_crashes >= 2 * n,
        "{router_crashes} Router crashes over {n} seeds"
    );
    assert!(
        router_restarts >= 2 * n,
        "{router_restarts} Router restarts over {n} seeds"
    );
    assert!(crashes >= n, "{crashes} engine crashes over {n} seeds");
    assert!(
        cut >= n,
        "{cut} streams cut with their Router over {n} seeds"
    );
    assert_eq!(both_placed, n, "a Router placed nothing in some seeds");
}
