//! What the multi-process tests share: the Python that drives a server
//! with the real `openai` client, and running one of the repository's
//! client scripts against it.

use std::process::Command;

/// The Python interpreter with the `openai` package (`FLOTILLA_PYTHON`,
/// else `python3` when it has it), or `None` (skip) outside CI.
pub fn openai_python() -> Option<String> {
    if let Ok(p) = std::env::var("FLOTILLA_PYTHON") {
        return Some(p);
    }
    let ok = Command::new("python3")
        .args(["-c", "import openai"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        assert!(
            std::env::var("CI").is_err(),
            "CI must provide the openai client (FLOTILLA_PYTHON)"
        );
        eprintln!("SKIPPED: no python with the openai package (set FLOTILLA_PYTHON)");
        return None;
    }
    Some("python3".into())
}

/// Runs `tests/{script}` with `python` against the server at `base` (its
/// URL without `/v1`) as `key`; the script must pass and print ALL OK.
pub fn run_client_script(python: &str, base: &str, key: &str, script: &str) {
    let script = format!("{}/../../tests/{script}", env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(python)
        .arg(&script)
        .env("OPENAI_BASE_URL", format!("{base}/v1"))
        .env("OPENAI_API_KEY", key)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{script} failed");
    assert!(stdout.contains("ALL OK"), "{stdout}");
}
