//! Whole runs: determinism, faults that fire, invariants that catch.

use flotilla_sim::{Scenario, SimError, run};

/// Every request sent ended one way: finished, refused, failed or dropped.
fn assert_accounted(t: &flotilla_sim::TierReport, r: &flotilla_sim::Report) {
    assert_eq!(
        t.sent,
        t.finished + t.refused + t.failed + t.cancelled,
        "{r}"
    );
}

/// Two engines on the CPU preset with the default model, two tiers.
fn small(extra: &str) -> Scenario {
    let text = format!(
        r#"
[run]
duration_s = 4.0
drain_s = 60.0

[model]
preset = "smollm2-135m"

[gpu]
preset = "cpu"

[engine]
max_num_seqs = 16
max_num_batched_tokens = 256
max_model_len = 1024

[topology]
engines = 2

[cluster]
heartbeat_interval_ms = 100
down_after_missed = 3

[[tiers]]
name = "paid"
priority = 2
weight = 4

[[slos]]
tier = "paid"
ttft_ms = 2000
tpot_ms = 200

[[tiers]]
name = "free"

[[slos]]
tier = "free"
ttft_ms = 5000
tpot_ms = 500

[[tenants]]
name = "p"
tier = "paid"

[[traffic]]
tenant = "p"
arrivals = {{ kind = "poisson", rate_per_s = 4.0 }}
prompt = {{ kind = "lognormal", mu = 4.0, sigma = 0.6, min = 8, max = 400 }}
output = {{ kind = "uniform", min = 4, max = 24 }}
cancel_fraction = 0.1

[[tenants]]
name = "f"
tier = "free"

[[traffic]]
tenant = "f"
arrivals = {{ kind = "closed", clients = 3 }}
prompt = {{ kind = "fixed", tokens = 64 }}
output = {{ kind = "fixed", tokens = 16 }}
{extra}
"#
    );
    Scenario::parse(&text).unwrap()
}

#[test]
fn the_same_seed_gives_the_same_trace() {
    let sc = small("");
    let a = run(&sc, 7).unwrap();
    let b = run(&sc, 7).unwrap();
    assert_eq!(a, b, "two runs of seed 7 differ");
    let c = run(&sc, 8).unwrap();
    assert_ne!(a.trace_hash, c.trace_hash, "seed 8 replayed seed 7");
    let paid = &a.tiers[0];
    assert!(paid.sent >= 8 && paid.finished > 0, "{a}");
    assert!(paid.cancelled > 0, "no client left mid-stream: {a}");
    assert!(a.output_tokens > 0 && a.events > paid.sent, "{a}");
}

#[test]
fn a_fault_storm_keeps_every_invariant() {
    let sc = small(
        r#"
[network]
loss = 0.01
duplicate = 0.01
reorder = 0.01

[[faults]]
at_s = 1.0
kind = "crash"
node = 2

[[faults]]
at_s = 1.5
kind = "partition"
a = 0
b = 1

[[faults]]
at_s = 1.6
kind = "heal"

[[faults]]
at_s = 2.0
kind = "restart"
node = 2

[[faults]]
at_s = 2.5
kind = "clog"
a = 1
b = 0

[[faults]]
at_s = 2.6
kind = "unclog"
"#,
    );
    let r = match run(&sc, 3) {
        Ok(r) => r,
        Err(e) => panic!("{e}"),
    };
    let f = r.faults;
    assert_eq!((f.crashes, f.restarts), (1, 1), "{r}");
    assert!(f.partitioned > 0 && f.clogged > 0, "{r}");
    assert!(f.lost > 0 && f.duplicated > 0 && f.reordered > 0, "{r}");
    // Requests on the crashed node that had streamed tokens move to the
    // other node and finish there; those that had not are re-run.
    let t = &r.tiers[0];
    assert_accounted(t, &r);
    assert!(t.finished > 0, "{r}");
    assert!(r.moved > 0, "no stream moved: {r}");
    assert_eq!(t.failed, 0, "{r}");
    assert!(r.pauses_ms.len() as u64 >= r.moved, "{r}");
}

#[test]
fn requests_that_never_end_break_the_run_with_its_seed() {
    // No time to drain: requests still in flight at the end are a failure.
    let mut sc = small("");
    sc.run.drain_s = 0.0;
    match run(&sc, 11) {
        Err(SimError::Invariant { seed, what, .. }) => {
            assert_eq!(seed, 11);
            assert!(what.contains("still pending"), "{what}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_enabled_fault_that_never_fires_fails_the_run() {
    // The two mixed engines never talk to each other: a partition between
    // them holds nothing, so the scenario does not test what it says.
    let idle = "[[faults]]\nat_s = 1.0\nkind = \"partition\"\na = 1\nb = 2\n\n\
                [[faults]]\nat_s = 2.0\nkind = \"heal\"\n";
    match run(&small(idle), 5) {
        Err(SimError::Invariant { what, .. }) => assert!(what.contains("partition"), "{what}"),
        other => panic!("{other:?}"),
    }
    // A per-message fault whose expected count in the run is tiny may
    // miss it by chance: not a failure of the run (swarms total it).
    let r = run(&small("[network]\nloss = 1e-12\n"), 5).unwrap();
    assert_eq!(r.faults.lost, 0);
    assert!(r.faults.messages > 100, "{r}");
}

#[test]
fn bad_scenarios_are_refused_with_the_reason() {
    let e = Scenario::parse("[run]\nduration_s = 1\n").unwrap_err();
    assert!(e.to_string().contains("missing field"), "{e}");
    let base = std::fs::read_to_string(shipped().join("fault-storm.toml")).unwrap();
    for (from, to, why) in [
        ("duration_s = 30.0", "duration_s = -1.0", "duration_s"),
        (
            "preset = \"a100\"",
            "preset = \"tpu\"",
            "unknown gpu preset",
        ),
        // A preset's fields set beside its name: only its own fields.
        (
            "preset = \"a100\"",
            "preset = \"a100\"\nmem_byts = 1e9",
            "[gpu]: unknown field `mem_byts`",
        ),
        (
            "preset = \"a100\"",
            "preset = \"a100\"\nmem_bytes = \"big\"",
            "[gpu]: invalid type",
        ),
        // The config's tables are read as a config file's: the error
        // names the line and the field.
        (
            "name = \"app\"\ntier = \"paid\"",
            "name = \"app\"\ntier = \"gold\"",
            "scenario:46: tenant 'app': unknown tier 'gold' (tiers: paid)",
        ),
        (
            "name = \"app\"\n",
            "name = \"app\"\nwieght = 2\n",
            "unknown field `wieght`",
        ),
        (
            "[[tiers]]\nname = \"paid\"\n",
            "[[tiers]]\nname = \"paid\"\nweight = 0\n",
            "weight must be > 0",
        ),
        // Every tier has its objective and every tenant its traffic.
        (
            "[[slos]]\ntier = \"paid\"",
            "[[slos]]\ntier = \"gold\"",
            "has no [[slos]] table",
        ),
        (
            "tenant = \"app\"",
            "tenant = \"apq\"",
            "has no [[traffic]] table",
        ),
        (
            "[topology]\n",
            "[topology]\nnodes = 3\n",
            "unknown field `nodes`",
        ),
        ("node = 2", "node = 9", "outside"),
        ("loss = 0.001", "loss = 2.0", "network.loss"),
        ("kind = \"crash\"", "kind = \"explode\"", "unknown variant"),
        ("[engine]\n", "[engine]\nblock_size = 0\n", "block_size"),
        (
            "[engine]\n",
            "[engine]\nqueue_timeout_s = -1.0\n",
            "queue_timeout_s",
        ),
        (
            "[network]\n",
            "[network]\nbandwidth = 0.0\n",
            "network.bandwidth",
        ),
        ("at_s = 5.0", "at_s = inf", "outside"),
        // Timing and limits are checked as a cluster config's are.
        (
            "heartbeat_interval_ms = 100",
            "heartbeat_interval_ms = 5",
            "cluster.heartbeat_interval_ms = 5 is out of range 10..=60000",
        ),
        (
            "[cluster]\n",
            "[cluster]\nframe_len_max_bytes = 100\n",
            "cluster.frame_len_max_bytes = 100",
        ),
        (
            "[cluster]\n",
            "[cluster]\nidle_timeout_ms = 150\n",
            "idle_timeout_ms = 150 must be at least",
        ),
        // The frame cap and idle timeout are the cluster's, not the link's.
        (
            "[network]\n",
            "[network]\nidle_timeout_ms = 150\n",
            "unknown field `idle_timeout_ms`",
        ),
    ] {
        assert!(base.contains(from), "{from}");
        let e = Scenario::parse(&base.replacen(from, to, 1)).unwrap_err();
        assert!(e.to_string().contains(why), "{to}: {e}");
    }
}

/// `preset = ...` with fields beside it is the preset with those fields
/// replaced, the rest the preset's: the small-KV scenario, once written
/// out field by field, reads the same both ways.
#[test]
fn a_preset_with_fields_set_is_the_preset_with_those_fields_replaced() {
    let text = std::fs::read_to_string(shipped().join("pd-kill-cancel-small-kv.toml")).unwrap();
    assert!(text.contains("preset = \"cpu\"\nname = \"cpu-small-kv\"\nmem_bytes = 1.91e8"));
    let s = Scenario::parse(&text).unwrap();
    let mut gpu = flotilla_sim::cost::GpuParams::preset("cpu").unwrap();
    gpu.name = "cpu-small-kv".into();
    gpu.mem_bytes = 1.91e8;
    assert_eq!(s.gpu_params().unwrap(), gpu);
    let mut model = flotilla_sim::cost::ModelShape::preset("smollm2-135m").unwrap();
    model.ctx_len = 2048;
    assert_eq!(s.model_shape().unwrap(), model);
    // The same figures written out in full.
    let full = text.replacen(
        "preset = \"cpu\"\n",
        "prefill_flops = 2.9e11\ndecode_flops = 2.4e11\nmem_bw = 3.0e10\n\
         overhead_s = 0.0003\nattn_prefill_flops = 6.3e10\nattn_decode_flops = 1.3e10\n\
         overlap = false\nhost_link_bw = 1.0e10\n",
        1,
    );
    assert_eq!(Scenario::parse(&full).unwrap().gpu_params().unwrap(), gpu);
}

fn shipped() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../simulations")
}

#[test]
fn every_shipped_scenario_parses() {
    let mut n = 0;
    for e in std::fs::read_dir(shipped()).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "toml") {
            Scenario::load(&p).unwrap_or_else(|e| panic!("{e}"));
            n += 1;
        }
    }
    assert!(n >= 4, "{n} scenarios");
}

#[test]
fn the_shipped_fault_storm_holds_for_several_seeds() {
    let sc = Scenario::load(&shipped().join("fault-storm.toml")).unwrap();
    for seed in 1..=2 {
        let r = run(&sc, seed).unwrap_or_else(|e| panic!("{e}"));
        let f = r.faults;
        assert!(
            f.crashes == 1 && f.restarts == 1 && f.partitioned > 0 && f.clogged > 0,
            "{r}"
        );
        let t = &r.tiers[0];
        assert_accounted(t, &r);
        // The crashed node's streams move: none fails.
        assert!(r.moved > 0, "{r}");
        assert_eq!(t.failed, 0, "{r}");
    }
}

#[test]
fn the_shipped_disaggregated_fault_storm_holds() {
    let sc = Scenario::load(&shipped().join("pd-fault-storm.toml")).unwrap();
    let r = run(&sc, 1).unwrap_or_else(|e| panic!("{e}"));
    let f = r.faults;
    assert!(
        f.crashes == 2 && f.restarts == 1 && f.transfers > 100,
        "{r}"
    );
    let t = &r.tiers[0];
    assert_accounted(t, &r);
    assert_eq!(t.failed, 0, "{r}");
}

#[test]
fn disaggregated_serving_survives_a_dead_prefill_node() {
    use flotilla_sim::scenario::{FaultKind, FaultSection};
    let mut sc = small("");
    sc.topology.engines = 0;
    sc.topology.prefill = 2;
    sc.topology.decode = 2;
    // Node 1 is the first prefill node.
    sc.faults.push(FaultSection {
        at_s: 1.5,
        kind: FaultKind::Crash { node: 1 },
    });
    let r = run(&sc, 9).unwrap_or_else(|e| panic!("{e}"));
    assert!(r.faults.transfers > 10, "{r}");
    assert_eq!(r.faults.crashes, 1, "{r}");
    for t in &r.tiers {
        assert_accounted(t, &r);
        // A prefill node holds no stream: its requests are re-run, not failed.
        assert_eq!(t.failed, 0, "{r}");
        assert!(t.finished > 0, "{r}");
    }
    assert_eq!(run(&sc, 9).unwrap().trace_hash, r.trace_hash);
}

#[test]
fn closed_clients_stop_after_their_request_count() {
    let mut sc = small("");
    sc.config.tenants.truncate(1);
    sc.traffic.truncate(1);
    sc.traffic[0].arrivals = flotilla_sim::scenario::Arrivals::Closed {
        clients: 3,
        requests: Some(10),
    };
    sc.traffic[0].cancel_fraction = 0.0;
    let r = run(&sc, 2).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((r.tiers[0].sent, r.tiers[0].finished), (10, 10), "{r}");
}

/// A lone stream's time per token is the cost model's decode step, not
/// that rounded up to tokio's millisecond timer (a 6.2 ms step once showed
/// as 7.0 ms): the GpuWorker carries sub-millisecond remainders.
#[test]
fn a_lone_stream_decodes_at_the_cost_model_s_step_time() {
    lone_stream("", 2.0, false);
}

/// A constrained stream's every decode step also computes its mask: on the
/// CPU backend (the host is the device) that time adds to the step.
#[test]
fn a_constrained_lone_stream_pays_its_masks() {
    lone_stream("constrained_fraction = 1.0", 2.0, true);
}

/// One stream of 101 tokens after a 100-token prompt, masks costing
/// `mask_ms`; its TPOT must be the cost model's mean decode step, plus
/// `mask_ms` when it is `constrained`.
fn lone_stream(tenant_extra: &str, mask_ms: f64, constrained: bool) {
    use flotilla_sim::cost::{GpuParams, ModelShape, SeqCost, step_time};
    let mut sc = Scenario::parse(&format!(
        r#"
[run]
duration_s = 1.0
drain_s = 60.0
[model]
preset = "smollm2-135m"
[gpu]
preset = "cpu"
[engine]
max_num_seqs = 4
max_num_batched_tokens = 256
max_model_len = 1024
[topology]
engines = 1

[[tiers]]
name = "paid"

[[slos]]
tier = "paid"
ttft_ms = 100000
tpot_ms = 100000
[[tenants]]
name = "a"
tier = "paid"

[[traffic]]
tenant = "a"
arrivals = {{ kind = "closed", clients = 1, requests = 1 }}
prompt = {{ kind = "fixed", tokens = 100 }}
output = {{ kind = "fixed", tokens = 101 }}
{tenant_extra}
"#,
    ))
    .unwrap();
    // Masks of 2 ms (400 times the default), so their cost stands out.
    let mut gpu = GpuParams::preset("cpu").unwrap();
    gpu.mask_us = mask_ms * 1e3;
    sc.gpu = flotilla_sim::scenario::Named::Gpu(gpu);
    let r = run(&sc, 1).unwrap();
    let tpot = r.tiers[0].tpot_ms.0;
    // Decode steps at contexts 101..200: the mean step.
    let (g, m) = (
        GpuParams::preset("cpu").unwrap(),
        ModelShape::preset("smollm2-135m").unwrap(),
    );
    let want: f64 = (101..201)
        .map(|p| {
            step_time(
                &g,
                &m,
                &[SeqCost {
                    start_pos: p,
                    tokens: 1,
                }],
            )
            .as_secs_f64()
                * 1e3
        })
        .sum::<f64>()
        / 100.0
        + if constrained { mask_ms } else { 0.0 };
    assert!(
        (tpot - want).abs() < 0.05,
        "TPOT {tpot:.3} ms, step {want:.3} ms"
    );
}

/// 24 closed-loop streams of ~1,200 tokens (600 prompt, 600 output) on one
/// engine of the CPU preset whose KV cache holds 600 blocks (9,600
/// tokens, 8 such streams): they preempt one another. `offload_bytes` of
/// host memory for the KV offload tier (0: none).
fn overload(offload_bytes: u64) -> flotilla_sim::Report {
    let sc = Scenario::parse(&format!(
        r#"
[run]
duration_s = 600.0
drain_s = 600.0

[model]
preset = "smollm2-135m"

[gpu]
name = "cpu-small-kv"
prefill_flops = 2.9e11
decode_flops = 2.4e11
mem_bw = 3.0e10
overhead_s = 0.0003
attn_prefill_flops = 6.3e10
attn_decode_flops = 1.3e10
overlap = false
# 98 MB of weights and 600 blocks of 368,640 bytes, over 0.9.
mem_bytes = 355e6
host_link_bw = 1.0e10

[engine]
max_num_seqs = 24
max_num_batched_tokens = 512
max_model_len = 2048
queue_timeout_s = 600
kv_offload_bytes = {offload_bytes}

[topology]
engines = 1

[[tiers]]
name = "paid"

[[slos]]
tier = "paid"
ttft_ms = 60000
tpot_ms = 1000

[[tenants]]
name = "app"
tier = "paid"

[[traffic]]
tenant = "app"
arrivals = {{ kind = "closed", clients = 24, requests = 48 }}
prompt = {{ kind = "fixed", tokens = 600 }}
output = {{ kind = "fixed", tokens = 600 }}
"#
    ))
    .unwrap();
    run(&sc, 1).unwrap_or_else(|e| panic!("{e}"))
}

/// The simulator models the offload tier: under preemption the tier's
/// restores (charged at the host link's bandwidth) replace recomputation,
/// so the same 48 requests finish sooner; without a tier nothing moves.
#[test]
fn the_offload_tier_turns_preemption_recompute_into_restores() {
    let without = overload(0);
    let with = overload(2_000 * 368_640);
    for r in [&without, &with] {
        assert_eq!(r.tiers[0].finished, 48, "{r}");
        assert!(r.preemptions > 0, "no preemption: {r}");
    }
    assert_eq!(without.offload, Default::default(), "{without}");
    assert_eq!(with.offload.total, 2_000, "{with}");
    assert!(
        with.offload.spilled > 0 && with.offload.restored > 0 && with.offload.hits > 0,
        "{with}"
    );
    assert!(
        with.sim_s < without.sim_s,
        "restoring was not faster than recomputing: {:.1} s with the tier, {:.1} s without",
        with.sim_s,
        without.sim_s
    );
    eprintln!("without a tier: {without}\nwith a tier: {with}");
}

/// The real config's tenant weights and tier reservations reach the
/// simulated engines (the scenario's tables carry them as a config file's
/// do), and the figures show the weights at work: two tenants of one tier
/// that both keep more requests waiting than the engine runs split its
/// output about as their weights, 3 to 1.
#[test]
fn tenant_weights_and_tier_reservations_reach_the_engines_and_the_figures() {
    let text = r#"
[run]
duration_s = 6.0
drain_s = 60.0

[model]
preset = "smollm2-135m"

[gpu]
preset = "cpu"

[engine]
max_num_seqs = 4
max_num_batched_tokens = 256
max_model_len = 1024

[[tiers]]
name = "paid"
priority = 2
kv_reserved_blocks = 24

[[slos]]
tier = "paid"
ttft_ms = 2000
tpot_ms = 200

[[tiers]]
name = "free"

[[slos]]
tier = "free"
ttft_ms = 60000
tpot_ms = 5000

[[tenants]]
name = "p"
tier = "paid"

[[traffic]]
tenant = "p"
arrivals = { kind = "poisson", rate_per_s = 0.5 }
prompt = { kind = "fixed", tokens = 32 }
output = { kind = "fixed", tokens = 8 }

[[tenants]]
name = "heavy"
tier = "free"
weight = 3

[[traffic]]
tenant = "heavy"
arrivals = { kind = "closed", clients = 12 }
prompt = { kind = "fixed", tokens = 32 }
output = { kind = "fixed", tokens = 32 }

[[tenants]]
name = "light"
tier = "free"
weight = 1

[[traffic]]
tenant = "light"
arrivals = { kind = "closed", clients = 12 }
prompt = { kind = "fixed", tokens = 32 }
output = { kind = "fixed", tokens = 32 }
"#;
    let sc = Scenario::parse(text).unwrap();
    let cfg = &sc.config;
    assert_eq!(cfg.tiers[0].kv_reserved_blocks, 24);
    let weights: Vec<u32> = cfg.tenants.iter().map(|t| t.weight).collect();
    assert_eq!(weights, [1, 3, 1]);
    let r = run(&sc, 3).unwrap();
    let by = |n: &str| r.tenants.iter().find(|t| t.name == n).unwrap().clone();
    let (heavy, light) = (by("heavy"), by("light"));
    assert_eq!((heavy.weight, light.weight), (3, 1));
    let ratio = heavy.output_tokens as f64 / light.output_tokens.max(1) as f64;
    eprintln!("{r}heavy/light output tokens: {ratio:.2}");
    assert!(
        (1.8..4.5).contains(&ratio),
        "weights 3:1 split the tier's output {ratio:.2}:1\n{r}"
    );
    let shown = r.to_string();
    assert!(
        shown.contains("tenant heavy") && shown.contains("weight 3"),
        "{shown}"
    );
    // The split is the weights' doing: equal weights split it evenly.
    let even = Scenario::parse(&text.replace("weight = 3", "weight = 1")).unwrap();
    let r = run(&even, 3).unwrap();
    let by = |n: &str| {
        r.tenants
            .iter()
            .find(|t| t.name == n)
            .unwrap()
            .output_tokens as f64
    };
    let ratio = by("heavy") / by("light").max(1.0);
    assert!(
        (0.75..1.33).contains(&ratio),
        "equal weights split it {ratio:.2}:1\n{r}"
    );
}

/// A paid tier's KV reservation under a free flood that fills the KV
/// cache, as a config file sets it (`[[tiers]] kv_reserved_blocks`): with
/// it, paid requests find blocks at once instead of waiting for (or
/// preempting) free ones, and the figures show both the setting and its
/// effect.
#[test]
fn a_tier_reservation_keeps_a_paid_tier_fast_under_a_free_flood_that_fills_the_kv() {
    const TEXT: &str = r#"
[run]
duration_s = 20.0
drain_s = 120.0

[model]
preset = "smollm2-135m"
ctx_len = 1024

[gpu]
preset = "cpu"
name = "cpu-small-kv"
mem_bytes = 1.91e8

[engine]
max_num_seqs = 32
max_num_batched_tokens = 256
max_model_len = 1024

[[tiers]]
name = "paid"
priority = 2
kv_reserved_blocks = RESV

[[slos]]
tier = "paid"
ttft_ms = 1000
tpot_ms = 200

[[tiers]]
name = "free"

[[slos]]
tier = "free"
ttft_ms = 60000
tpot_ms = 5000

[[tenants]]
name = "p"
tier = "paid"

[[traffic]]
tenant = "p"
arrivals = { kind = "poisson", rate_per_s = 1.0 }
prompt = { kind = "fixed", tokens = 256 }
output = { kind = "fixed", tokens = 64 }

[[tenants]]
name = "flood"
tier = "free"

[[traffic]]
tenant = "flood"
arrivals = { kind = "closed", clients = 32 }
prompt = { kind = "fixed", tokens = 256 }
output = { kind = "fixed", tokens = 512 }
"#;
    let with = |blocks: u32| {
        let sc = Scenario::parse(&TEXT.replace("RESV", &blocks.to_string())).unwrap();
        assert_eq!(sc.config.tiers[0].kv_reserved_blocks, blocks);
        run(&sc, 3).unwrap_or_else(|e| panic!("{e}"))
    };
    let (open, reserved) = (with(0), with(64));
    eprintln!("{open}{reserved}");
    let (a, b) = (&open.tiers[0], &reserved.tiers[0]);
    assert_eq!((a.name.as_str(), a.failed, b.failed), ("paid", 0, 0));
    // The flood fills the cache: without a reservation paid requests
    // wait behind it.
    assert!(open.kv_util > 0.8, "{open}");
    assert!(
        b.ttft_ms.1 * 4.0 < a.ttft_ms.1,
        "paid TTFT p99 {:.0} ms reserved vs {:.0} ms open",
        b.ttft_ms.1,
        a.ttft_ms.1
    );
    assert!(b.within_slo > a.within_slo, "{open}{reserved}");
    assert!(reserved.preemptions < open.preemptions, "{open}{reserved}");
    let shown = reserved.to_string();
    assert!(
        shown.contains("tier paid") && shown.contains("64 KV blocks reserved per engine"),
        "{shown}"
    );
}

/// One group of `stages` stages (or one node, for 1) of the CPU preset
/// with the default model, `clients` closed-loop streams of 64 + 64
/// tokens, hops of `hop_us`.
fn grouped(stages: usize, clients: usize, hop_us: f64, extra: &str) -> Scenario {
    let pipeline = if stages > 1 {
        format!("[pipeline]\nstages = {stages}\nhop_latency_us = {hop_us}\nlink_gbps = 10\n")
    } else {
        String::new()
    };
    Scenario::parse(&format!(
        r#"
[run]
duration_s = 3.0
drain_s = 60.0
[model]
preset = "smollm2-135m"
[gpu]
preset = "cpu"
[engine]
max_num_seqs = 32
max_num_batched_tokens = 256
max_model_len = 1024
[topology]
engines = 1
{pipeline}
[[tiers]]
name = "paid"
[[slos]]
tier = "paid"
ttft_ms = 100000
tpot_ms = 100000
[[tenants]]
name = "a"
tier = "paid"
[[traffic]]
tenant = "a"
arrivals = {{ kind = "closed", clients = {clients} }}
prompt = {{ kind = "fixed", tokens = 64 }}
output = {{ kind = "fixed", tokens = 64 }}
{extra}
"#,
    ))
    .unwrap()
}

/// A lone stream through a group of two pays the step's cost (the stages
/// compute its halves one after the other) and two hops a token: one to
/// stage 1 and one back, each the link's latency and one hidden row's
/// bytes (576 f16 features) at its bandwidth.
#[test]
fn a_pipeline_group_s_lone_stream_pays_the_step_and_two_hops() {
    use flotilla_sim::cost::{GpuParams, ModelShape, SeqCost, step_time};
    let hop_us = 500.0;
    let one = run(&grouped(1, 1, hop_us, ""), 1).unwrap();
    let two = run(&grouped(2, 1, hop_us, ""), 1).unwrap();
    let (g, m) = (
        GpuParams::preset("cpu").unwrap(),
        ModelShape::preset("smollm2-135m").unwrap(),
    );
    // Steps at contexts 65..128 (a token's TPOT, averaged).
    let step: f64 = (65..128)
        .map(|p| {
            step_time(
                &g,
                &m,
                &[SeqCost {
                    start_pos: p,
                    tokens: 1,
                }],
            )
            .as_secs_f64()
                * 1e3
        })
        .sum::<f64>()
        / 63.0;
    let hop_ms = hop_us / 1e3 + 576.0 * 2.0 / (10e9 / 8.0) * 1e3;
    let (t1, t2) = (one.tiers[0].tpot_ms.0, two.tiers[0].tpot_ms.0);
    assert!(
        (t1 - step).abs() < 0.05,
        "one node: TPOT {t1:.3} ms, step {step:.3}"
    );
    assert!(
        (t2 - (step + 2.0 * hop_ms)).abs() < 0.05,
        "group: TPOT {t2:.3} ms, want {:.3}",
        step + 2.0 * hop_ms
    );
}

/// Sixteen streams through a group of two: its stages work on two
/// micro-batches at once, so it serves more than one node of the same
/// accelerator (each stage has its own), and less than twice as much
/// (a micro-batch of 8 costs more a token than a batch of 16 on a step
/// that reads every weight).
#[test]
fn a_pipeline_group_of_two_overlaps_its_micro_batches() {
    let one = run(&grouped(1, 16, 100.0, ""), 2).unwrap();
    let two = run(&grouped(2, 16, 100.0, ""), 2).unwrap();
    let three = run(&grouped(3, 16, 100.0, ""), 2).unwrap();
    for r in [&one, &two, &three] {
        assert_eq!(r.tiers[0].failed, 0, "{r}");
        assert!(r.tiers[0].finished >= 16, "{r}");
    }
    let ratio = two.throughput() / one.throughput();
    eprintln!(
        "16 streams: one node {:.0} tok/s, group of 2 {:.0}, group of 3 {:.0}",
        one.throughput(),
        two.throughput(),
        three.throughput()
    );
    assert!(
        (1.3..2.0).contains(&ratio),
        "group of 2 / one node: {ratio:.2} ({:.0} vs {:.0} tok/s)",
        two.throughput(),
        one.throughput()
    );
    let ratio3 = three.throughput() / one.throughput();
    assert!(
        ratio3 > ratio && ratio3 < 3.0,
        "group of 3 / one node: {ratio3:.2}, group of 2: {ratio:.2}"
    );
}

/// Stage 1 of one of two groups crashes under load and comes back: the
/// group's requests move to the other group with no stream failing, and
/// the group forms again and serves.
#[test]
fn a_lost_stage_moves_its_group_s_streams_and_the_group_forms_again() {
    let mut sc = grouped(
        2,
        12,
        100.0,
        r#"
[[faults]]
at_s = 1.0
kind = "stage_crash"
node = 1
stage = 1

[[faults]]
at_s = 1.8
kind = "stage_restart"
node = 1
stage = 1
"#,
    );
    sc.topology.engines = 2;
    sc.run.duration_s = 4.0;
    sc.run.check_every_step = true;
    let r = run(&sc, 5).unwrap_or_else(|e| panic!("{e}"));
    let (f, t) = (r.faults, &r.tiers[0]);
    assert_eq!((f.stage_crashes, f.stage_restarts), (1, 1), "{r}");
    assert_eq!(r.groups_formed_again, 1, "{r}");
    assert!(r.moved > 0, "no stream moved off the broken group: {r}");
    assert_eq!(t.failed, 0, "{r}");
    assert_accounted(t, &r);
}

#[test]
fn bad_pipeline_sections_are_refused() {
    for (extra, why) in [
        ("[pipeline]\nstages = 31\n", "not in 2..=30"),
        ("[pipeline]\nstages = 2\nlink_gbps = 0\n", "link_gbps"),
        (
            "[pipeline]\nstages = 2\nactivations = \"i4\"\n",
            "f16 or f32",
        ),
        (
            "[pipeline]\nstages = 2\n[[faults]]\nat_s = 1.0\nkind = \"stage_crash\"\nnode = 1\nstage = 2\n",
            "stage 2 is not in 1..2",
        ),
        (
            "[[faults]]\nat_s = 1.0\nkind = \"stage_crash\"\nnode = 1\nstage = 1\n",
            "stage 1 is not in 1..1",
        ),
        ("[chaos]\nstage_crashes = 1\n", "no [pipeline] groups"),
    ] {
        let text = format!(
            "[run]\nduration_s = 3.0\n[model]\npreset = \"smollm2-135m\"\n[gpu]\npreset = \"cpu\"\n\
             [[tiers]]\nname = \"paid\"\n[[slos]]\ntier = \"paid\"\nttft_ms = 1000\ntpot_ms = 100\n\
             [[tenants]]\nname = \"a\"\ntier = \"paid\"\n[[traffic]]\ntenant = \"a\"\n\
             arrivals = {{ kind = \"poisson\", rate_per_s = 1.0 }}\n\
             prompt = {{ kind = \"fixed\", tokens = 8 }}\noutput = {{ kind = \"fixed\", tokens = 8 }}\n\
             {extra}"
        );
        let e = Scenario::parse(&text).unwrap_err().to_string();
        assert!(e.contains(why), "{extra}: {e}");
    }
}

/// A group drains as a node does (issue 45): told to drain under load, it
/// takes nothing new, lets what runs finish for its grace, then leaves,
/// and the Router moves the rest with their KV blocks, read from the
/// group's stages; the group restarts empty. No request fails or is
/// refused.
#[test]
fn a_pipeline_group_drains_as_a_node_does() {
    let mut sc = grouped(
        2,
        12,
        100.0,
        r#"
[[faults]]
at_s = 1.0
kind = "drain"
node = 1
grace_ms = 300

[[faults]]
at_s = 2.5
kind = "restart"
node = 1
"#,
    );
    sc.topology.engines = 2;
    sc.run.duration_s = 4.0;
    sc.run.check_every_step = true;
    let r = run(&sc, 9).unwrap_or_else(|e| panic!("{e}"));
    let (f, t) = (r.faults, &r.tiers[0]);
    assert_eq!((f.drains, f.drained, f.restarts), (1, 1, 1), "{r}");
    assert_eq!((t.failed, t.refused), (0, 0), "{r}");
    assert!(
        r.moved > 0 && r.moved_by_kv > 0,
        "nothing moved with its KV: {r}"
    );
    assert_accounted(t, &r);
}

/// The simulator's pipeline group against the real one (issue 45): the
/// fitted scenario of `simulations/pipeline-1.5b-cpu.toml` as a group, as
/// one node (no `[pipeline]`) and as a group with 2 ms more a round trip
/// (1 ms a hop), each figure within 15% of what `tests/bench/pipeline.sh`
/// measured on that machine in one run (docs/BENCHMARKS.md).
#[test]
fn the_simulated_pipeline_group_agrees_with_the_real_one() {
    let base = Scenario::load(&shipped().join("pipeline-1.5b-cpu.toml")).unwrap();
    let mut one = base.clone();
    one.pipeline = None;
    let mut delayed = base.clone();
    if let Some(p) = delayed.pipeline.as_mut() {
        p.hop_latency_us += 1000.0;
    }
    let lone = |sc: &Scenario| {
        let mut sc = sc.clone();
        sc.traffic[0].arrivals = flotilla_sim::scenario::Arrivals::Closed {
            clients: 1,
            requests: Some(6),
        };
        run(&sc, 1).unwrap().tiers[0].tpot_ms.0
    };
    // (what, simulated, measured by tests/bench/pipeline.sh).
    let figures = [
        (
            "one node, 16 streams, tok/s",
            run(&one, 1).unwrap().throughput(),
            15.16,
        ),
        (
            "group, 16 streams, tok/s",
            run(&base, 1).unwrap().throughput(),
            21.27,
        ),
        (
            "group +2 ms, 16 streams, tok/s",
            run(&delayed, 1).unwrap().throughput(),
            19.90,
        ),
        ("one node, 1 stream, TPOT ms", lone(&one), 128.5),
        ("group, 1 stream, TPOT ms", lone(&base), 130.9),
    ];
    for (what, sim, real) in figures {
        eprintln!(
            "{what}: simulated {sim:.1}, measured {real:.1} ({:+.0}%)",
            (sim / real - 1.0) * 100.0
        );
    }
    for (what, sim, real) in figures {
        assert!(
            (sim / real - 1.0).abs() <= 0.15,
            "{what}: simulated {sim:.2}, measured {real:.2}"
        );
    }
}

/// `simulations/draft-7b-h100.toml` with `[engine] speculative` set to
/// `mode` and the closed clients' count and requests set.
fn draft_scenario(mode: &str, clients: usize, requests: usize, acceptance: f64) -> Scenario {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../simulations/draft-7b-h100.toml"
    ))
    .unwrap()
    .replace(
        "speculative = \"draft\"",
        &format!("speculative = \"{mode}\""),
    )
    .replace(
        "clients = 1, requests = 4",
        &format!("clients = {clients}, requests = {requests}"),
    )
    .replace(
        "draft_acceptance = 0.8",
        &format!("draft_acceptance = {acceptance}"),
    );
    let text = if mode == "draft" {
        text
    } else {
        text.replace("draft_model = \"llama-1b\"\n", "")
    };
    Scenario::parse(&text).unwrap()
}

/// The cost model's prediction for a draft model: a lone 7B stream on an
/// H100 with a 1.1B draft right 80% of the time decodes faster, by 1.29x
/// when this was written (not the seed's ~2x: the preset charges every
/// pass, the draft's too, its 2 ms fixed cost, so four draft passes cost
/// more than the 7B's step); a draft that is seldom right is turned down by
/// the cost sum and costs next to nothing; a full batch is never slower
/// (the cost sum turns the draft off as the batch grows). Printed: the
/// figures are a prediction, not a measurement.
#[test]
fn the_simulator_predicts_what_a_draft_model_gains_and_never_loses() {
    let tpot = |mode: &str, acceptance: f64| {
        let r = run(&draft_scenario(mode, 1, 4, acceptance), 3).unwrap();
        assert_eq!(r.tiers[0].finished, 4, "{r}");
        r.tiers[0].tpot_ms.0
    };
    let off = tpot("off", 0.8);
    let on = tpot("draft", 0.8);
    let gain = off / on;
    eprintln!(
        "7B on an H100, one stream: TPOT {off:.2} ms off, {on:.2} ms with a 1.1B draft at 80%: {gain:.2}x"
    );
    assert!((1.15..3.0).contains(&gain), "{gain}");
    // A draft that is seldom right: the measured acceptance turns it down.
    let poor = tpot("draft", 0.1);
    eprintln!("at 10% acceptance: TPOT {poor:.2} ms ({:.2}x)", off / poor);
    assert!(poor < off * 1.1, "{poor} {off}");
    // A full batch: output tokens a second, off and with the draft.
    let rate = |mode: &str| {
        let r = run(&draft_scenario(mode, 96, 192, 0.8), 3).unwrap();
        assert_eq!(r.tiers[0].finished, 192, "{r}");
        r.output_tokens as f64 / r.sim_s
    };
    let (full_off, full_on) = (rate("off"), rate("draft"));
    eprintln!(
        "96 streams: {full_off:.0} tok/s off, {full_on:.0} with the draft ({:.2}x)",
        full_on / full_off
    );
    assert!(full_on >= 0.95 * full_off, "{full_on} {full_off}");
}

/// Two Routers; the second dies at 1.5 s and comes back at 2.5 s: its
/// streams break off (counted as cut, nothing else fails), the first
/// Router's run on, the engines give back the dead one's blocks (the run's
/// end finds every block back), and the second places again once back.
#[test]
fn a_router_s_death_cuts_only_its_own_streams() {
    use flotilla_sim::scenario::{FaultKind, FaultSection};
    let mut sc = small("");
    sc.topology.routers = 2;
    sc.faults.push(FaultSection {
        at_s: 1.5,
        kind: FaultKind::RouterCrash { router: 1 },
    });
    sc.faults.push(FaultSection {
        at_s: 2.5,
        kind: FaultKind::RouterRestart { router: 1 },
    });
    let r = run(&sc, 5).unwrap();
    eprintln!("{r}");
    assert_eq!(
        (
            r.faults.router_crashes,
            r.faults.router_restarts,
            r.faults.crashes
        ),
        (1, 1, 0),
        "{r}"
    );
    assert!(r.cut_by_router > 0, "no stream ran on the dead Router: {r}");
    let failed: u64 = r.tiers.iter().map(|t| t.failed).sum();
    assert_eq!(
        failed, r.cut_by_router,
        "only the dead Router's streams failed: {r}"
    );
    assert!(r.placed_by_router.iter().all(|&p| p > 0), "{r}");
    for t in &r.tiers {
        assert_accounted(t, &r);
    }
    // Routers and their faults out of range are refused with the reason.
    let text = std::fs::read_to_string(shipped().join("router-storm.toml")).unwrap();
    let e = Scenario::parse(&text.replace("routers = 2", "routers = 1")).unwrap_err();
    assert!(e.to_string().contains("router_crashes = 3: needs"), "{e}");
    let e = Scenario::parse(&text.replace("routers = 2", "routers = 9")).unwrap_err();
    assert!(e.to_string().contains("topology.routers = 9"), "{e}");
    let e = Scenario::parse(&format!(
        "{text}\n[[faults]]\nat_s = 2.0\nkind = \"router_crash\"\nrouter = 2\n"
    ))
    .unwrap_err();
    assert!(e.to_string().contains("router 2 is not in 0..2"), "{e}");
}

/// Three engines, the third in no config: it joins at 1 s (the Routers
/// learn of it from its connection, as from the QUIC transport) and takes
/// work; in a second run it also drains at 2.5 s and, down past
/// `forget_after_ms`, is forgotten. Every request is accounted for, every
/// block back at the end. A join of a node that is not a joiner, and more
/// joiners than engines, are refused.
#[test]
fn a_node_joins_takes_work_leaves_and_is_forgotten() {
    use flotilla_sim::scenario::{FaultKind, FaultSection};
    let mut sc = small("");
    sc.topology.engines = 3;
    sc.topology.joiners = 1;
    sc.cluster.forget_after_ms = 1000;
    sc.faults.push(FaultSection {
        at_s: 1.0,
        kind: FaultKind::Join { node: 3 },
    });
    let r = run(&sc, 5).unwrap();
    eprintln!("{r}");
    assert_eq!(r.faults.joins, 1, "{r}");
    let joined = r.nodes.iter().find(|n| n.0 == "engine-3").expect("known");
    assert!(
        joined.1 && joined.2 > 0,
        "the joined node took no work: {:?}",
        r.nodes
    );
    for t in &r.tiers {
        assert_accounted(t, &r);
        assert_eq!(t.failed, 0, "{r}");
    }

    sc.faults.push(FaultSection {
        at_s: 2.5,
        kind: FaultKind::Drain {
            node: 3,
            grace_ms: 300,
        },
    });
    let r = run(&sc, 5).unwrap();
    eprintln!("{r}");
    assert_eq!((r.faults.joins, r.faults.drained), (1, 1), "{r}");
    let names: Vec<&str> = r.nodes.iter().map(|n| n.0.as_str()).collect();
    assert_eq!(names, ["engine-1", "engine-2"], "forgotten after it left");
    for t in &r.tiers {
        assert_accounted(t, &r);
        assert_eq!(t.failed, 0, "{r}");
    }

    let mut bad = sc.clone();
    bad.faults.push(FaultSection {
        at_s: 1.0,
        kind: FaultKind::Join { node: 2 },
    });
    let e = bad.validate().unwrap_err().to_string();
    assert!(e.contains("node 2 is not one of the joiners [3]"), "{e}");
    let mut bad = sc.clone();
    bad.topology.joiners = 3;
    let e = bad.validate().unwrap_err().to_string();
    assert!(e.contains("topology.joiners = 3 of 3 engines"), "{e}");
}

/// Fast mode equals the exact mode on every shipped scenario whose faults
/// are not drawn at random: each request ends the same way, and its TTFT,
/// TPOT and latency are within 1% (or the clock's 1 ms grain). A scenario
/// whose arrivals last long is cut to its first `CAP_S` seconds (and its
/// faults' times), so the exact runs stay short; the report lists each
/// scenario's worst request.
#[test]
fn fast_mode_equals_the_exact_mode_on_every_scenario_without_random_faults() {
    const CAP_S: f64 = 20.0;
    let mut paths: Vec<std::path::PathBuf> = std::fs::read_dir(shipped())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    paths.sort();
    let mut compared = Vec::new();
    let mut failures = Vec::new();
    for p in &paths {
        let mut sc = Scenario::load(p).unwrap();
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        if sc.chaos.is_some() {
            continue;
        }
        if let Some(why) = sc.fast_refusal() {
            // Refused, with the reason: its faults are per message.
            assert!(why.contains("network."), "{name}: {why}");
            continue;
        }
        let last_fault = sc.faults.iter().map(|f| f.at_s).fold(0.0, f64::max);
        sc.run.duration_s = sc.run.duration_s.min(CAP_S.max(last_fault + 5.0));
        let c = flotilla_sim::compare(&sc, 1).unwrap_or_else(|e| panic!("{name}: {e}"));
        eprintln!("{name}:\n{c}");
        assert!(
            c.compared > 0,
            "{name}: no request finished in both modes\n{c}"
        );
        if !c.equal() {
            failures.push(format!("{name}:\n{c}"));
        }
        compared.push(name);
    }
    assert!(compared.len() >= 8, "only {compared:?} compared");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Fast mode is refused, with the reason, for a scenario whose faults are
/// drawn per message; a scheduled fault makes it run step by step around
/// that fault's time, and the crash still moves the node's streams.
#[test]
fn fast_mode_refuses_per_message_faults_and_goes_step_by_step_around_a_crash() {
    let mut lossy = small("[network]\nloss = 0.01\n");
    lossy.sim.mode = flotilla_sim::SimMode::Fast;
    match run(&lossy, 1) {
        Err(SimError::Scenario(e)) => {
            let m = e.to_string();
            assert!(
                m.contains("network.loss") && m.contains("without --fast"),
                "{m}"
            );
        }
        other => panic!("a lossy scenario ran fast: {other:?}"),
    }
    let mut sc = small(
        "[[faults]]\nat_s = 2.0\nkind = \"crash\"\nnode = 1\n\n\
         [[faults]]\nat_s = 3.0\nkind = \"restart\"\nnode = 1\n",
    );
    sc.sim.mode = flotilla_sim::SimMode::Fast;
    let r = run(&sc, 1).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.exact_spans.len(), 1, "{:?}", r.exact_spans);
    let (a, b) = r.exact_spans[0];
    assert!(a < 2.0 && a > 1.0 && b > 3.0, "{:?}", r.exact_spans);
    assert_eq!(r.faults.crashes, 1, "{r}");
    let c = flotilla_sim::compare(&sc, 1).unwrap_or_else(|e| panic!("{e}"));
    assert!(c.equal(), "{c}");
}

/// A JSONL trace replays its requests at their times with their lengths,
/// looped to fill the run; `speed` scales its rate, and a plan's rate
/// scaling is a speed.
#[test]
fn a_trace_replays_its_requests_at_their_times_with_their_lengths() {
    let dir = std::env::temp_dir().join(format!("flotilla-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("trace.jsonl");
    std::fs::write(
        &trace,
        "{\"t\": 0.0, \"prompt_tokens\": 40, \"output_tokens\": 5, \"tenant\": \"p\"}\n\
         {\"t\": 0.5, \"prompt_tokens\": 60, \"output_tokens\": 9, \"tenant\": \"f\"}\n\
         \n\
         {\"t\": 1.0, \"prompt_tokens\": 80, \"output_tokens\": 7, \"tenant\": \"p\"}\n",
    )
    .unwrap();
    let mut sc = small("");
    sc.replay(&trace).unwrap();
    for t in &mut sc.traffic {
        t.cancel_fraction = 0.0;
    }
    // One lap: 1 s and one mean gap (0.5 s); 4 s of arrivals: laps at 0,
    // 1.5 and 3 s, each p at +0 and +1 s, f at +0.5 s.
    let r = run(&sc, 3).unwrap_or_else(|e| panic!("{e}"));
    let of = |tenant: u64| -> Vec<(f64, u64)> {
        r.requests
            .iter()
            .filter(|q| q.key >> 48 == tenant)
            .map(|q| (q.sent.as_secs_f64(), q.tokens))
            .collect()
    };
    let p = of(0);
    // Sent times from the first request's (at the trace's t = 0; the run's
    // clock starts before, while the engines first report).
    let t0 = p[0].0;
    let sent = |v: &[(f64, u64)]| {
        v.iter()
            .map(|x| ((x.0 - t0) * 1000.0).round() / 1000.0)
            .collect::<Vec<_>>()
    };
    assert_eq!(sent(&p), [0.0, 1.0, 1.5, 2.5, 3.0], "{r}");
    assert_eq!(
        p.iter().map(|x| x.1).collect::<Vec<_>>(),
        [5, 7, 5, 7, 5],
        "{r}"
    );
    let f = of(1);
    assert_eq!(sent(&f), [0.5, 2.0, 3.5], "{r}");
    assert!(f.iter().all(|x| x.1 == 9), "{r}");
    // At twice the recorded rate: twice the requests, the same lengths.
    assert!((flotilla_sim::plan::offered_rate(&sc).unwrap() - 2.0).abs() < 1e-9);
    let fast = flotilla_sim::plan::at_rate(&sc, 4.0).unwrap();
    let r2 = run(&fast, 3).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r2.requests.len(), 16, "{r2}");
    // What a trace cannot be: each refused with its line or its reason.
    for (text, why) in [
        (
            "{\"t\": -1, \"prompt_tokens\": 4, \"output_tokens\": 4, \"tenant\": \"p\"}",
            "line 1",
        ),
        (
            "{\"t\": 0, \"prompt_tokens\": 0, \"output_tokens\": 4, \"tenant\": \"p\"}",
            "at least 1",
        ),
        (
            "{\"t\": 0, \"prompt_tokens\": 4, \"tenant\": \"p\"}",
            "output_tokens",
        ),
        (
            "{\"t\": 0, \"prompt_tokens\": 4, \"output_tokens\": 4, \"tenant\": \"x\"}\n{\"t\": 1, \"prompt_tokens\": 4, \"output_tokens\": 4, \"tenant\": \"x\"}",
            "tenant 'x'",
        ),
        (
            "{\"t\": 2, \"prompt_tokens\": 4, \"output_tokens\": 4, \"tenant\": \"p\"}\n{\"t\": 2, \"prompt_tokens\": 4, \"output_tokens\": 4, \"tenant\": \"p\"}",
            "one instant",
        ),
        ("", "no requests"),
        (
            "{\"t\": 0, \"prompt_tokens\": 5000, \"output_tokens\": 4, \"tenant\": \"p\"}\n{\"t\": 1, \"prompt_tokens\": 4, \"output_tokens\": 4, \"tenant\": \"p\"}",
            "max_model_len",
        ),
    ] {
        std::fs::write(&trace, text).unwrap();
        let e = small("").replay(&trace).unwrap_err().to_string();
        assert!(e.contains(why), "{text}: {e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
