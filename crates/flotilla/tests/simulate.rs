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
