//! The Python the tests drive (the real `openai` client against a running
//! server, the numpy references that write tiny models): `$FLOTILLA_PYTHON`
//! when set, else a virtual environment this module makes on first use in
//! the cache, as the default model is fetched on first use, so that the
//! README's one test command checks the same things on a fresh machine as
//! CI does. A machine without Python 3 fails with what to install.
//!
//! ```text
//! <cache>/test-python/<key>/            the environment (key: the package pins)
//! <cache>/test-python/<key>/.complete   written once every package installed
//! <cache>/test-python/.lock             held around check + make
//! ```

use std::fs::{self, OpenOptions};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

/// What the tests' Python needs: the same pins as `.ci/run`.
pub const TEST_PYTHON_PACKAGES: &[&str] = &[
    "openai>=1.40,<3",
    "numpy>=1.26,<3",
    "gguf==0.19.0",
    "jsonschema>=4.20,<5",
    "kubernetes-validate==1.37.0",
];

/// The tests' Python: `$FLOTILLA_PYTHON`, else the cached environment
/// (made on first use; concurrent tests wait on a lock). The error says
/// what to install.
pub fn test_python() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("FLOTILLA_PYTHON").filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    let cache = super::cache_dir().map_err(|e| e.to_string())?;
    ensure_env(&cache.join("test-python"), "python3", TEST_PYTHON_PACKAGES)
}

/// A virtual environment under `root` with `packages`, made with `python`
/// unless a complete one is there; returns its interpreter.
fn ensure_env(root: &Path, python: &str, packages: &[&str]) -> Result<PathBuf, String> {
    let key = {
        let mut h = Sha256::new();
        for p in packages {
            h.update(p.as_bytes());
            h.update([0]);
        }
        let d = h.finalize();
        d[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    let dir = root.join(key);
    let interp = dir.join("bin").join("python");
    let done = dir.join(".complete");
    if done.exists() && interp.exists() {
        return Ok(interp);
    }
    fs::create_dir_all(root).map_err(|e| format!("creating {}: {e}", root.display()))?;
    let lock_path = root.join(".lock");
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| format!("opening {}: {e}", lock_path.display()))?;
    lock.lock()
        .map_err(|e| format!("locking {}: {e}", lock_path.display()))?;
    // Another test may have made it while this one waited.
    if done.exists() && interp.exists() {
        return Ok(interp);
    }
    let what = format!(
        "the tests need Python 3 with venv and pip to make their environment \
         (Debian/Ubuntu: `apt-get install python3 python3-venv`), or \
         FLOTILLA_PYTHON naming a Python that has {}",
        packages.join(", ")
    );
    let run = |cmd: &mut Command, step: &str| -> Result<(), String> {
        match cmd.output() {
            Ok(o) if o.status.success() => Ok(()),
            Ok(o) => Err(format!(
                "{step} failed: {}\n{what}",
                String::from_utf8_lossy(&o.stderr).trim()
            )),
            Err(e) => Err(format!("{step}: cannot run it ({e})\n{what}")),
        }
    };
    // A half-made environment (a test killed mid-install) is made anew.
    let _ = fs::remove_dir_all(&dir);
    eprintln!(
        "making the tests' Python environment in {} (first use only)",
        dir.display()
    );
    run(
        Command::new(python).args(["-m", "venv"]).arg(&dir),
        &format!("`{python} -m venv`"),
    )?;
    run(
        Command::new(&interp)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .args(packages),
        "installing the tests' packages with pip",
    )?;
    fs::write(&done, packages.join("\n"))
        .map_err(|e| format!("writing {}: {e}", done.display()))?;
    let _ = lock.unlock();
    Ok(interp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_python_is_an_error_that_says_what_to_install() {
        let root = std::env::temp_dir().join(format!("flotilla-testenv-{}", std::process::id()));
        let err = ensure_env(&root, "/nonexistent/python3", &["openai"]).unwrap_err();
        assert!(
            err.contains("apt-get install python3 python3-venv"),
            "{err}"
        );
        assert!(
            err.contains("FLOTILLA_PYTHON") && err.contains("openai"),
            "{err}"
        );
        // Nothing is taken for complete after a failure.
        assert!(
            fs::read_dir(&root)
                .unwrap()
                .all(|e| !e.unwrap().path().join(".complete").exists())
        );
        fs::remove_dir_all(&root).ok();
    }
}
