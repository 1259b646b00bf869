//! The CPU KV cache is sized from the memory cgroup's limit, not the
//! host's memory: `flotilla serve` started inside a cgroup this test makes
//! (as root) with a 1 GiB limit says so in `/ready` and sizes its cache as
//! the fraction (0.5 here) of that limit less the weights. It needs root and a memory
//! cgroup it can make (v1, or v2 with the memory controller delegated);
//! elsewhere it says why and returns, unless `FLOTILLA_REQUIRE_CGROUP=1`
//! (CI, which runs as root) makes that a failure.

// Only the HTTP helpers of the shared module are used here.
#[allow(dead_code)]
mod common;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

const LIMIT: u64 = 1 << 30;

/// A memory cgroup made for this test, removed on drop (after its process).
struct Cgroup {
    dir: PathBuf,
    version: &'static str,
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Makes a child of this process's memory cgroup (v1), or of a v2 cgroup
/// whose children get the memory controller, with a limit of `LIMIT`.
fn make_cgroup() -> Result<Cgroup, String> {
    let pc = std::fs::read_to_string("/proc/self/cgroup").map_err(|e| e.to_string())?;
    let mi = std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| e.to_string())?;
    let name = format!("flotilla-test-{}", std::process::id());
    let mut tried = Vec::new();
    for m in mi.lines() {
        let Some((pre, post)) = m.split_once(" - ") else {
            continue;
        };
        let pre: Vec<&str> = pre.split(' ').collect();
        let post: Vec<&str> = post.split(' ').collect();
        let (root, point) = (pre[3], PathBuf::from(pre[4]));
        let v1 = post[0] == "cgroup" && post[2].split(',').any(|o| o == "memory");
        let v2 = post[0] == "cgroup2";
        if !v1 && !v2 {
            continue;
        }
        let own = pc.lines().find_map(|l| {
            let mut f = l.splitn(3, ':');
            let (id, ctl, path) = (f.next()?, f.next()?, f.next()?);
            let hit = if v2 {
                id == "0" && ctl.is_empty()
            } else {
                ctl.split(',').any(|c| c == "memory")
            };
            hit.then_some(path)
        });
        let Some(own) = own else { continue };
        let rel = own
            .strip_prefix(root)
            .unwrap_or(own)
            .trim_start_matches('/');
        let own_dir = point.join(rel);
        // v2: a parent must hand the memory controller to its children
        // (and, not the root, hold no processes): try the mount's root.
        let parent = if v2 { point.clone() } else { own_dir };
        if v2 {
            let sub =
                std::fs::read_to_string(parent.join("cgroup.subtree_control")).unwrap_or_default();
            if !sub.split_whitespace().any(|c| c == "memory") {
                tried.push(format!("{}: memory not delegated", parent.display()));
                continue;
            }
        }
        let dir = parent.join(&name);
        if let Err(e) = std::fs::create_dir(&dir) {
            tried.push(format!("{}: {e}", dir.display()));
            continue;
        }
        let cg = Cgroup {
            dir,
            version: if v2 { "v2" } else { "v1" },
        };
        let file = if v2 {
            "memory.max"
        } else {
            "memory.limit_in_bytes"
        };
        if let Err(e) = std::fs::write(cg.dir.join(file), LIMIT.to_string()) {
            tried.push(format!("{}: {e}", cg.dir.join(file).display()));
            continue;
        }
        return Ok(cg);
    }
    Err(format!(
        "no memory cgroup could be made ({})",
        tried.join("; ")
    ))
}

#[tokio::test]
async fn the_kv_cache_is_sized_from_the_cgroup_limit() {
    let required = std::env::var("FLOTILLA_REQUIRE_CGROUP").is_ok_and(|v| v == "1");
    let cg = match make_cgroup() {
        Ok(cg) => cg,
        Err(why) => {
            assert!(!required, "FLOTILLA_REQUIRE_CGROUP=1: {why}");
            eprintln!("not checked here (needs root and a memory cgroup): {why}");
            return;
        }
    };
    let model = flotilla_hub::test_model_path();
    let procs = cg.dir.join("cgroup.procs");
    // The shell joins the cgroup, then becomes the server.
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "echo $$ > '{}' && exec \"$0\" \"$@\"",
            procs.display()
        ))
        .arg(env!("CARGO_BIN_EXE_flotilla"))
        .args([
            "serve",
            "--no-auth",
            "--port",
            "0",
            "--kv-cache-fraction",
            "0.5",
        ])
        .arg("--model")
        .arg(&model)
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn flotilla serve in the cgroup");
    let base = common::server_url(
        child.stderr.take().unwrap(),
        "server",
        Duration::from_secs(120),
    );
    let result = async {
        let base = base.ok_or_else(|| "the server did not print its URL".to_string())?;
        // The process is in the cgroup (the fault this test injects held).
        let members = std::fs::read_to_string(&procs).unwrap_or_default();
        if !members.lines().any(|p| p.trim() == child.id().to_string()) {
            return Err(format!(
                "pid {} not in {}: {members}",
                child.id(),
                procs.display()
            ));
        }
        let ready = common::ready(&base).await;
        let config = common::get_json(&base, "/config", None).await;
        Ok::<_, String>((ready, config))
    }
    .await;
    let _ = child.kill();
    let _ = child.wait();
    let (ready, config) = result.unwrap();
    let m = &ready["memory"];
    eprintln!("{}: {m}", cg.version);
    assert_eq!(m["cgroup_limit_bytes"], LIMIT, "{m}");
    assert!(
        m["source"]
            .as_str()
            .unwrap()
            .starts_with(&format!("cgroup {}", cg.version)),
        "{m}"
    );
    let weights = m["weights_bytes"].as_u64().unwrap();
    let file_len = std::fs::metadata(&model).unwrap().len();
    assert!(
        weights > file_len / 2 && weights < file_len,
        "{weights} of {file_len}"
    );
    assert_eq!(m["budget_bytes"], LIMIT - weights, "{m}");
    // Half the limit less the weights, in whole blocks.
    let blocks = config["kv_cache_blocks"].as_u64().unwrap();
    let bytes = config["kv_cache_bytes"].as_u64().unwrap();
    let per_block = bytes / blocks;
    let want = ((LIMIT - weights) as f64 * 0.5) as u64;
    assert!(
        bytes <= want && want - bytes < per_block,
        "{bytes} vs {want}"
    );
    assert_eq!(config["memory"], *m);
}
