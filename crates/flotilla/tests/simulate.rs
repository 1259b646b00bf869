//! `flotilla simulate`: the same scenario and seed print the same trace
//! hash from two separate processes.

use std::process::Command;

fn simulate(seed: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(["simulate", "--seed", seed])
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../simulations/fault-storm.toml"
        ))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text.lines()
        .find(|l| l.starts_with("trace: "))
        .unwrap_or_else(|| panic!("no trace line in {text}"))
        .to_string()
}

#[test]
fn two_processes_replay_the_same_seed_byte_for_byte() {
    let a = simulate("4");
    assert_eq!(a, simulate("4"));
    assert_ne!(a, simulate("5"));
}

#[test]
fn a_missing_scenario_is_a_clear_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(["simulate", "simulations/no-such.toml"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no-such.toml"), "{err}");
}

/// A small workload: the CPU preset and the default model, one tier.
const PLAN_WORKLOAD: &str = r#"
[run]
duration_s = 120.0
drain_s = 60.0
check_every_step = false

[model]
preset = "smollm2-135m"

[gpu]
preset = "cpu"

[engine]
max_num_seqs = 16
max_num_batched_tokens = 512
max_model_len = 1024

[topology]
engines = 1

[[tiers]]
name = "paid"

[[slos]]
tier = "paid"
ttft_ms = 500
tpot_ms = 100

[[tenants]]
name = "app"
tier = "paid"

[[traffic]]
tenant = "app"
arrivals = { kind = "poisson", rate_per_s = 2.0 }
prompt = { kind = "uniform", min = 32, max = 256 }
output = { kind = "uniform", min = 16, max = 64 }
"#;

/// A fresh directory of its own under the system's temp dir.
fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("flotilla-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn plan(dir: &std::path::Path, workload: &str, extra: &[&str]) -> std::process::Output {
    let file = dir.join("workload.toml");
    std::fs::write(&file, workload).unwrap();
    Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .arg("plan")
        .arg(&file)
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn plan_finds_each_configuration_s_highest_rate_and_the_cheapest_for_a_target() {
    let dir = scratch("plan");
    let out_dir = dir.join("out");
    let out = plan(
        &dir,
        PLAN_WORKLOAD,
        &[
            "--slo",
            "paid:ttft_p99=500ms,tpot_p99=100ms",
            "--nodes",
            "1,2",
            "--prefill-shares",
            "0",
            "--max-num-seqs",
            "16",
            "--kv-dtypes",
            "f16",
            "--precision",
            "0.1",
            "--target-rate",
            "3",
            "--out",
            out_dir.to_str().unwrap(),
        ],
    );
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Each configuration's rate, from its line.
    let rate = |label: &str| -> f64 {
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with(label) && l.contains("runs)"))
            .unwrap_or_else(|| panic!("no line for {label} in {text}"));
        let at = line.find("req/s").unwrap();
        line[..at]
            .split_whitespace()
            .last()
            .unwrap()
            .parse()
            .unwrap()
    };
    let (one, two) = (rate("1 mixed"), rate("2 mixed"));
    assert!(one > 0.0, "{text}");
    // Two nodes serve more than one, and not beyond twice as much (the
    // searches are 10% apart at most).
    assert!(two > one * 1.3 && two < one * 2.5, "{one} {two}\n{text}");
    let csv = std::fs::read_to_string(out_dir.join("pareto.csv")).unwrap();
    assert_eq!(csv.lines().count(), 3, "{csv}");
    assert!(
        std::fs::read_to_string(out_dir.join("plan.html"))
            .unwrap()
            .contains("<svg")
    );
    // The target: the cheapest that serves it, and its config.
    if one >= 3.0 {
        assert!(text.contains("cheapest for 3.00 req/s: 1 mixed"), "{text}");
    } else {
        assert!(text.contains("cheapest for 3.00 req/s: 2 mixed"), "{text}");
    }
    let cfg = std::fs::read_to_string(out_dir.join("cluster.toml")).unwrap();
    assert!(
        cfg.contains("role = \"worker\"") && cfg.contains("max_num_seqs = 16"),
        "{cfg}"
    );
}

#[test]
fn plan_refuses_what_it_cannot_plan_with_the_reason() {
    let dir = scratch("plan-refusals");
    let cases: [(&str, &[&str], &str); 4] = [
        (
            PLAN_WORKLOAD,
            &["--slo", "gold:ttft_p99=1s"],
            "--slo names tier 'gold'",
        ),
        (PLAN_WORKLOAD, &["--slo", "paid:ttft=1s"], "not ttft_pN"),
        (
            &PLAN_WORKLOAD.replace(
                r#"{ kind = "poisson", rate_per_s = 2.0 }"#,
                r#"{ kind = "closed", clients = 4 }"#,
            ),
            &["--slo", "paid:ttft_p99=1s"],
            "closed-loop clients",
        ),
        (
            &format!("{PLAN_WORKLOAD}\n[network]\nloss = 0.01\n"),
            &["--slo", "paid:ttft_p99=1s"],
            "fast mode cannot honour",
        ),
    ];
    for (workload, args, why) in cases {
        let out = plan(&dir, workload, args);
        assert!(!out.status.success(), "{args:?} ran");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(why), "{args:?}: {err}");
    }
}

/// The highest rate of the one configuration a plan printed.
fn planned_rate(out: &std::process::Output) -> f64 {
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = text
        .lines()
        .skip_while(|l| !l.starts_with("Pareto front"))
        .nth(1)
        .unwrap_or_else(|| panic!("no front: {text}"));
    let at = line.find(" req/s").unwrap();
    line[..at]
        .split_whitespace()
        .last()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn plan_takes_a_fitted_machine_file_and_a_recorded_trace() {
    let dir = scratch("plan-fit-trace");
    let one = [
        "--nodes",
        "1",
        "--prefill-shares",
        "0",
        "--max-num-seqs",
        "16",
        "--kv-dtypes",
        "f16",
        "--slo",
        "paid:ttft_p99=1s",
    ];
    let preset = planned_rate(&plan(&dir, PLAN_WORKLOAD, &one));
    // A machine half as fast as the `cpu` preset in every FLOP rate, as
    // `bench-model --fit` writes one: its plan serves less.
    let fit = dir.join("fit.toml");
    std::fs::write(
        &fit,
        r#"[gpu]
name = "half-cpu"
prefill_flops = 1.45e11
decode_flops = 1.2e11
mem_bw = 1.5e10
overhead_s = 0.0003
attn_prefill_flops = 3.15e10
attn_decode_flops = 6.5e9
overlap = false
mem_bytes = 2.678e9

[model]
name = "smollm2"
params = 1.35e8
weight_bytes_per_param = 0.726
n_layer = 30
q_width = 576
n_head_kv = 3
head_dim = 64
vocab = 49152
ctx_len = 8192
window = 0
window_layers = 0
"#,
    )
    .unwrap();
    let mut args = one.to_vec();
    let fit_arg = fit.display().to_string();
    args.extend(["--gpu", fit_arg.as_str()]);
    let fitted = planned_rate(&plan(&dir, PLAN_WORKLOAD, &args));
    assert!(
        fitted < 0.8 * preset,
        "half the FLOP/s served {fitted} req/s against {preset}"
    );
    // A file without the shape it was fitted with is refused.
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "[gpu]\nname = \"x\"\n").unwrap();
    let bad_arg = bad.display().to_string();
    let mut args = one.to_vec();
    args.extend(["--gpu", bad_arg.as_str()]);
    let out = plan(&dir, PLAN_WORKLOAD, &args);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bench-model --fit"), "{err}");
    // A recorded trace in place of the Poisson arrivals: 2 req/s as
    // recorded (a request every 0.5 s), planned at its own scale.
    let trace = dir.join("trace.jsonl");
    let rows: String = (0..40)
        .map(|i| {
            format!(
                "{{\"t\": {}, \"prompt_tokens\": {}, \"output_tokens\": 32, \"tenant\": \"app\"}}\n",
                f64::from(i) * 0.5,
                64 + 4 * i
            )
        })
        .collect();
    std::fs::write(&trace, rows).unwrap();
    let trace_arg = trace.display().to_string();
    let mut args = one.to_vec();
    args.extend(["--trace", trace_arg.as_str()]);
    let out = plan(&dir, PLAN_WORKLOAD, &args);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(text.contains("(2.00 req/s as recorded)"), "{text}");
    assert!(planned_rate(&out) > 0.5, "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}
