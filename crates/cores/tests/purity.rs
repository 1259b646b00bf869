//! The cores stay plain: nothing they build on (their normal dependencies,
//! as `cargo tree` resolves them) brings a runtime, a network stack, an
//! actor system, a telemetry exporter or a random source. `clippy.toml`
//! bans clocks and randomness in their code; this bans them beneath it.

use std::collections::BTreeSet;
use std::process::Command;

/// Crates the cores must not reach, by name.
const FORBIDDEN: [&str; 8] = [
    "tokio",
    "quinn",
    "ractor",
    "rustls",
    "opentelemetry_sdk",
    "opentelemetry-otlp",
    "rand",
    "getrandom",
];

/// The names of every crate `package` builds on (normal edges only).
fn normal_deps(package: &str) -> BTreeSet<String> {
    let out = Command::new(env!("CARGO"))
        .args([
            "tree",
            "--offline",
            "-e",
            "normal",
            "--prefix",
            "none",
            "-p",
            package,
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("running cargo tree");
    assert!(
        out.status.success(),
        "cargo tree -p {package}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

#[test]
fn the_cores_build_on_plain_data_only() {
    let cores = normal_deps("flotilla-cores");
    // The walk sees what the cores do use (so it would see the rest) ...
    for used in ["flotilla-proto", "rkyv", "crc32fast"] {
        assert!(
            cores.contains(used),
            "{used} not found under the cores: {cores:?}"
        );
    }
    // ... and the shells do reach what the cores must not.
    assert!(normal_deps("flotilla-cluster").contains("tokio"));
    let bad: Vec<&str> = FORBIDDEN
        .iter()
        .copied()
        .filter(|f| cores.contains(*f))
        .collect();
    assert!(bad.is_empty(), "flotilla-cores depends on {bad:?}");
}
