//! The `flotilla generate` command end to end: stdout carries only the
//! generated text, diagnostics go to stderr, bad input is a clear error.

use std::process::Command;

fn flotilla() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_flotilla"));
    c.env("FLOTILLA_TEST_MODEL", flotilla_hub::test_model_path());
    c
}

fn model_arg() -> String {
    flotilla_hub::test_model_path().display().to_string()
}

#[test]
fn chat_generation_prints_only_the_answer() {
    let out = flotilla()
        .args([
            "generate",
            "--chat",
            "--prompt",
            "What is 2+2?",
            "--max-tokens",
            "24",
            "--threads",
            "1",
            "--model",
        ])
        .arg(model_arg())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The greedy answer of the reference (tests/fixtures/greedy.json, chat_math),
    // cut at <|im_end|>, which ends generation and is not printed.
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        "The answer to this classic math problem is 4.\n"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("end of sequence") && err.contains("prompt tokens"),
        "{err}"
    );
}

#[test]
fn same_seed_same_text() {
    let run = |seed: &str| {
        let out = flotilla()
            .args([
                "generate",
                "--prompt",
                "Once upon a time",
                "--max-tokens",
                "12",
                "--temperature",
                "0.9",
            ])
            .args(["--seed", seed, "--threads", "1", "--model"])
            .arg(model_arg())
            .output()
            .unwrap();
        assert!(out.status.success());
        String::from_utf8(out.stdout).unwrap()
    };
    let a = run("7");
    assert_eq!(a, run("7"));
    let others: Vec<String> = ["8", "9", "10"].iter().map(|s| run(s)).collect();
    assert!(
        others.iter().any(|o| *o != a),
        "three other seeds all gave {a:?}"
    );
}

#[test]
fn bad_input_is_a_clear_error() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["generate", "--prompt", "x", "--model", "/nonexistent.gguf"],
            "no such file, and not a known model name (smollm2-135m, gemma3-270m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b)",
        ),
        (
            &["generate", "--prompt", "x", "--model", "gemma3-27b"],
            "not a known model name",
        ),
        (
            &["generate", "--prompt", "x", "--temperature=-1"],
            "temperature",
        ),
        (&["generate", "--prompt", "x", "--top-p", "0"], "top_p"),
        (
            &["generate", "--prompt", "x", "--kernel", "fast"],
            "--kernel",
        ),
        (
            &["generate", "--prompt", "x", "--kv-cache-dtype", "int3"],
            "KV cache dtype",
        ),
        (
            &["generate", "--prompt", "x", "--threads", "0"],
            "--threads",
        ),
    ];
    for (args, needle) in cases {
        let mut c = flotilla();
        c.args(*args);
        if !args.contains(&"--model") {
            c.args(["--model", &model_arg()]);
        }
        let out = c.output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?} should fail");
        assert!(out.stdout.is_empty(), "{args:?} wrote to stdout");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(needle) && !err.contains("panicked"),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn a_file_that_is_not_gguf_is_refused() {
    let path = std::env::temp_dir().join(format!("flotilla-not-gguf-{}.gguf", std::process::id()));
    std::fs::write(&path, b"this is not a model file at all").unwrap();
    let out = flotilla()
        .args(["generate", "--prompt", "x", "--model"])
        .arg(&path)
        .output()
        .unwrap();
    std::fs::remove_file(&path).ok();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a GGUF file"), "{err}");
}

#[test]
fn a_gpu_device_without_a_driver_or_an_unknown_device_is_a_clear_error() {
    let out = flotilla()
        .args(["serve", "--device", "tpu:0", "--port", "0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("expected cpu, cuda or cuda:N"), "{err}");
    if flotilla_cuda::driver_present() {
        eprintln!("SKIPPED the no-driver half: this machine has a CUDA driver");
        return;
    }
    let out = flotilla()
        .args(["serve", "--device", "cuda:0", "--port", "0", "--model"])
        .arg(model_arg())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("no CUDA driver") && !err.contains("panicked"),
        "{err}"
    );
}

/// `--model gemma3-270m` names a model: `fetch-model` prints the verified
/// cache path, and `generate` runs it by name, raw completion being the main
/// use of this base model (the reference's greedy tokens of
/// tests/fixtures/gemma3/greedy.json, raw_france).
#[test]
fn gemma3_by_name() {
    // Fetched (or found) in the cache the other tests use.
    let path = flotilla_hub::test_gemma3_path();
    if std::env::var_os("FLOTILLA_TEST_GEMMA3").is_some() {
        eprintln!("skipped: FLOTILLA_TEST_GEMMA3 points elsewhere than the cache");
        return;
    }
    let out = flotilla()
        .args(["fetch-model", "--model", "gemma3-270m"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8(out.stdout).unwrap().trim(),
        path.display().to_string()
    );
    let out = flotilla()
        .args([
            "generate",
            "--model",
            "gemma3-270m",
            "--prompt",
            "The capital of France is",
            "--max-tokens",
            "8",
            "--threads",
            "1",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        " the capital of the country of France.\n"
    );
}

/// `bench-model --pp-depth` runs the prompt test after that much context
/// (sized into the KV cache and named in the table), beside decode at
/// depth; a zero length is refused by name.
#[test]
fn bench_model_measures_a_prompt_at_depth() {
    let run = |extra: &[&str]| {
        flotilla()
            .args(["bench-model", "--no-peer", "--threads", "1", "--reps", "1"])
            .args(["--tg", "2", "--tg-depth", "20", "--batches", "2"])
            .args(["--batch-prompt", "8", "--batch-gen", "2", "--model"])
            .arg(model_arg())
            .args(extra)
            .output()
            .unwrap()
    };
    let out = run(&["--pp", "16", "--pp-depth", "200"]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    // 216 positions of 16: the prompt test's table, the largest here.
    assert!(stderr.contains(" x 14 blocks of 16"), "{stderr}");
    let rate = |name: &str| -> f64 {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("| {name} |")))
            .unwrap_or_else(|| panic!("{name} in {stdout}"));
        line.split('|').nth(2).unwrap().trim().parse().unwrap()
    };
    assert!(rate("pp16 @ depth 200") > 0.0);
    assert!(rate("tg2 @ depth 20") > 0.0);
    let out = run(&["--pp", "0"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--pp"));
    // A depth past the model's context (8,192 tokens), however large, is
    // refused by name before any memory is taken for it.
    for depth in ["8177", "18446744073709551615"] {
        let out = run(&["--pp", "16", "--pp-depth", depth]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{err}");
        assert!(
            err.contains("--pp-depth and --pp") && err.contains("context of 8192"),
            "{err}"
        );
    }
}

/// `serve` off loopback without `--config` refuses before it loads the
/// model (a model path that does not exist is never reached), and says
/// what to do; `--no-auth` or a config gets past the check (to the model's
/// own error here), as does loopback.
#[test]
fn serve_refuses_the_example_keys_off_loopback() {
    let run = |extra: &[&str]| {
        let out = flotilla()
            .args(["serve", "--port", "0", "--model", "/nonexistent/model.gguf"])
            .args(extra)
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    for host in ["0.0.0.0", "::", "192.0.2.7"] {
        let e = run(&["--host", host]);
        assert!(
            e.contains("example config's API keys")
                && e.contains("--no-auth")
                && e.contains("--config"),
            "{host}: {e}"
        );
    }
    let cfg = format!(
        "{}/../../cluster-configs/single-node.toml",
        env!("CARGO_MANIFEST_DIR")
    );
    for extra in [
        &["--host", "0.0.0.0", "--no-auth"][..],
        &["--host", "0.0.0.0", "--config", &cfg][..],
        &["--host", "127.0.0.1"][..],
        &["--host", "::1"][..],
    ] {
        let e = run(extra);
        assert!(!e.contains("example config's API keys"), "{extra:?}: {e}");
        assert!(
            e.contains("nonexistent"),
            "{extra:?} should reach the model: {e}"
        );
    }
}

/// Every flag of every subcommand, from `--help` (subcommands followed).
fn all_flags(path: &mut Vec<String>, out: &mut std::collections::BTreeSet<String>) {
    let help = flotilla().args(path.iter()).arg("--help").output().unwrap();
    assert!(help.status.success(), "{path:?} --help");
    let text = String::from_utf8_lossy(&help.stdout).into_owned();
    out.extend(flags_in(&text));
    let mut in_commands = false;
    let mut subs = Vec::new();
    for line in text.lines() {
        if line.starts_with("Commands:") {
            in_commands = true;
        } else if in_commands && line.starts_with("  ") {
            let name = line.split_whitespace().next().unwrap_or("");
            if !name.is_empty() && name != "help" {
                subs.push(name.to_string());
            }
        } else if in_commands && !line.trim().is_empty() {
            in_commands = false;
        }
    }
    for s in subs {
        path.push(s);
        all_flags(path, out);
        path.pop();
    }
}

/// `--flag` words of `text`.
fn flags_in(text: &str) -> Vec<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .filter(|w| w.starts_with("--") && w.len() > 2 && w.as_bytes()[2].is_ascii_lowercase())
        .map(|w| w.trim_end_matches('-').to_string())
        .collect()
}

/// The docs a user reads name only flags that exist: README, docs/,
/// deploy/ (manifests, unit, README), the example configs and the
/// benchmark scripts, against every subcommand's `--help`. Flags of other
/// programs the docs show (cargo, llama.cpp, kubectl, ...) are listed here.
#[test]
fn every_flag_the_docs_name_exists() {
    let mut ours = std::collections::BTreeSet::new();
    all_flags(&mut Vec::new(), &mut ours);
    assert!(
        ours.contains("--kv-cache-fraction") && ours.contains("--renew"),
        "{ours:?}"
    );
    let other_programs = [
        // cargo and its test runners
        "--release",
        "--workspace",
        "--locked",
        "--path",
        "--root",
        "--lib",
        "--test",
        "--example",
        "--ignored",
        "--nocapture",
        "--no-capture",
        // pip, useradd, systemctl, kubectl, kubernetes-validate
        "--strict",
        "--no-deps",
        "--no-binary",
        "--no-create-home",
        "--shell",
        "--now",
        "--from-file",
        "--raw",
        // llama.cpp's tools
        "--cache-ram",
        "--kl-divergence",
        "--kl-divergence-base",
        "--output-format",
        "--repack",
        "--rpc",
        "--spec-type",
        "--spec-draft-n-max",
    ];
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut files = vec![root.join("README.md"), root.join("CHANGELOG.md")];
    let mut dirs = vec![
        root.join("docs"),
        root.join("deploy"),
        root.join("cluster-configs"),
        root.join("tests/bench"),
    ];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else {
                files.push(p);
            }
        }
    }
    let mut missing = Vec::new();
    for f in &files {
        let Ok(text) = std::fs::read_to_string(f) else {
            continue;
        };
        for flag in flags_in(&text) {
            if !ours.contains(&flag) && !other_programs.contains(&flag.as_str()) {
                missing.push(format!("{}: {flag}", f.display()));
            }
        }
    }
    missing.sort();
    missing.dedup();
    assert!(
        missing.is_empty(),
        "flags named in the docs that no subcommand has: {missing:#?}"
    );
}

/// `[model]` in the config names what `serve` (and `node`) loads, so a unit
/// file needs no model flags; a flag given wins; a bad device is named.
#[test]
fn the_config_names_the_model_and_a_flag_overrides_it() {
    let dir = std::env::temp_dir().join(format!("flotilla-model-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("cluster.toml");
    let base = std::fs::read_to_string(format!(
        "{}/../../cluster-configs/single-node.toml",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap();
    let run = |model_table: &str, extra: &[&str]| {
        std::fs::write(&cfg, format!("{model_table}\n{base}")).unwrap();
        let out = flotilla()
            .args(["serve", "--port", "0", "--config"])
            .arg(&cfg)
            .args(extra)
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    // A relative path is read beside the config file.
    let e = run("[model]\nmodel = \"models/from-config.gguf\"\n", &[]);
    assert!(
        e.contains(&format!("{}/models/from-config.gguf", dir.display())),
        "{e}"
    );
    let e = run(
        "[model]\nmodel = \"models/from-config.gguf\"\n",
        &["--model", "/nonexistent/from-flag.gguf"],
    );
    assert!(
        e.contains("from-flag.gguf") && !e.contains("from-config"),
        "{e}"
    );
    let e = run("[model]\ndevice = \"gpu\"\n", &[]);
    assert!(e.contains("[model] device") && e.contains("gpu"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The multi-machine recipe of docs/CLUSTER.md (between its
/// `cluster-recipe` markers) runs as written, on one machine: certificates,
/// the config, three nodes, a chat completion through the router, a
/// worker's metrics.
#[test]
fn the_cluster_recipe_runs_as_written() {
    use std::os::unix::process::CommandExt;
    let readme = std::fs::read_to_string(format!(
        "{}/../../docs/CLUSTER.md",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap();
    let start = readme
        .find("<!-- cluster-recipe -->")
        .expect("the recipe's start marker");
    let end = readme
        .find("<!-- /cluster-recipe -->")
        .expect("the recipe's end marker");
    let script: String = readme[start..end]
        .lines()
        .filter(|l| !l.starts_with("```") && !l.starts_with("<!--"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(script.contains("flotilla node"), "{script}");
    // The model it names is the tests' default, fetched once per machine.
    let _ = flotilla_hub::test_model_path();
    let dir = std::env::temp_dir().join(format!("flotilla-recipe-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_flotilla"));
    let path = format!(
        "{}:{}",
        bin.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    /// Kills the recipe's process group (its background nodes) on drop.
    struct Group(u32);
    impl Drop for Group {
        fn drop(&mut self) {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", self.0)])
                .status();
        }
    }
    let child = Command::new("timeout")
        .args(["180", "bash", "-euo", "pipefail", "-c", &script])
        .current_dir(&dir)
        .env("PATH", path)
        .process_group(0)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("bash");
    let group = Group(child.id());
    let out = child.wait_with_output().unwrap();
    drop(group);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let logs: String = ["router", "worker-1", "worker-2"]
        .iter()
        .map(|n| {
            let l = std::fs::read_to_string(dir.join(format!("{n}.log"))).unwrap_or_default();
            format!("--- {n}.log\n{l}")
        })
        .collect();
    assert!(
        out.status.success(),
        "the recipe failed: {}\n{stdout}\n{}\n{logs}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let chat_line = stdout
        .lines()
        .find(|l| l.contains("chat.completion"))
        .unwrap_or_else(|| panic!("no completion in {stdout}\n{logs}"));
    let v: serde_json::Value = serde_json::from_str(chat_line).unwrap();
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() > 0, "{v}");
    assert!(stdout.contains("flotilla_kv_blocks"), "{stdout}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `node --help` lists no flag a node ignores, and a node refuses the
/// serve-only ones by name (its addresses come from its [[nodes]] table).
#[test]
fn node_has_no_serve_only_flags() {
    let help = flotilla().args(["node", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for f in ["--host", "--port", "--no-auth"] {
        assert!(!help.contains(f), "node --help lists {f}");
    }
    assert!(
        help.contains("--name") && help.contains("--model"),
        "{help}"
    );
    for extra in [&["--port", "9"][..], &["--host", "0.0.0.0"][..]] {
        let out = flotilla()
            .args([
                "node",
                "--config",
                "/nonexistent/cluster.toml",
                "--name",
                "router",
            ])
            .args(extra)
            .output()
            .unwrap();
        assert!(!out.status.success());
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(
            e.contains("--host and --port are for `flotilla serve`"),
            "{extra:?}: {e}"
        );
    }
}
