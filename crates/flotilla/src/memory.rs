//! How much memory this process may use, for sizing the CPU KV cache: the
//! memory cgroup's limit where one is set (cgroup v2 `memory.max`, v1
//! `memory.limit_in_bytes`, the smallest along the cgroup's path up to its
//! hierarchy's root), else what the host reports available. A container
//! with an 8 GiB limit on a 512 GiB host is sized from its 8 GiB.

use std::path::{Path, PathBuf};

/// A limit at or above this is "no limit" (v1 writes 2^63 rounded down to
/// a page; v2 writes `max`).
const UNLIMITED: u64 = 1 << 60;

/// The memory a KV cache fraction is taken of, and where it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryBudget {
    /// Bytes the fraction applies to.
    pub bytes: u64,
    /// The cgroup limit (its file and value), if one bounds this process.
    pub cgroup: Option<CgroupLimit>,
    /// The host's `MemAvailable`, if readable.
    pub host_available: Option<u64>,
    /// The weights' bytes, taken from a cgroup limit (they live inside it).
    pub weights: u64,
    /// Which of the two sized it, in words.
    pub source: String,
}

/// A memory cgroup's limit on this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CgroupLimit {
    /// Bytes.
    pub bytes: u64,
    /// The file that set it (the smallest along the path).
    pub file: PathBuf,
    /// `v1` or `v2`.
    pub version: &'static str,
}

impl MemoryBudget {
    /// The budget for a KV cache beside `weights` bytes of weights: a
    /// cgroup's limit less the weights, or the host's available memory
    /// when that is smaller or no cgroup limits the process (4 GiB when
    /// neither can be read). Errors when the limit cannot hold the weights.
    pub fn detect(weights: u64) -> Result<MemoryBudget, String> {
        let host = host_available();
        let cgroup = read_file("/proc/self/cgroup").and_then(|pc| {
            let mi = read_file("/proc/self/mountinfo")?;
            cgroup_limit(&pc, &mi, &|p| read_file(p))
        });
        MemoryBudget::choose(cgroup, host, weights)
    }

    /// [`MemoryBudget::detect`]'s decision, from what it read.
    pub fn choose(
        cgroup: Option<CgroupLimit>,
        host: Option<u64>,
        weights: u64,
    ) -> Result<MemoryBudget, String> {
        let Some(c) = cgroup else {
            return Ok(MemoryBudget {
                bytes: host.unwrap_or(4 << 30),
                cgroup: None,
                host_available: host,
                weights: 0,
                source: match host {
                    Some(_) => "host MemAvailable (no memory cgroup limit)".into(),
                    None => "4 GiB (neither a cgroup limit nor /proc/meminfo readable)".into(),
                },
            });
        };
        let Some(left) = c.bytes.checked_sub(weights).filter(|&b| b > 0) else {
            return Err(format!(
                "the memory cgroup's limit ({} bytes, {}) does not hold the model's {weights} bytes \
                 of weights: raise the container's memory limit or choose a smaller model",
                c.bytes,
                c.file.display()
            ));
        };
        let (bytes, source) = match host {
            Some(h) if h < left => (
                h,
                format!(
                    "host MemAvailable (below the cgroup {} limit {} less the weights)",
                    c.version,
                    c.file.display()
                ),
            ),
            _ => (
                left,
                format!(
                    "cgroup {} limit {} less the weights",
                    c.version,
                    c.file.display()
                ),
            ),
        };
        Ok(MemoryBudget {
            bytes,
            cgroup: Some(c),
            host_available: host,
            weights,
            source,
        })
    }

    /// As `/ready` and `GET /config` show it.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "source": self.source,
            "budget_bytes": self.bytes,
            "cgroup_limit_bytes": self.cgroup.as_ref().map(|c| c.bytes),
            "cgroup_limit_file": self.cgroup.as_ref().map(|c| c.file.display().to_string()),
            "host_available_bytes": self.host_available,
            "weights_bytes": self.weights,
        })
    }
}

fn read_file(p: impl AsRef<Path>) -> Option<String> {
    std::fs::read_to_string(p).ok()
}

/// The host's `MemAvailable`, bytes.
fn host_available() -> Option<u64> {
    let s = read_file("/proc/meminfo")?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// A cgroup file system mount: its root within the hierarchy, where it is
/// mounted, and its version.
struct Mount<'a> {
    root: &'a str,
    point: &'a str,
    v2: bool,
}

/// The memory cgroup mounts listed in `/proc/self/mountinfo` text: v2
/// (`cgroup2`) and v1 (`cgroup` with the `memory` option).
fn memory_mounts(mountinfo: &str) -> Vec<Mount<'_>> {
    mountinfo
        .lines()
        .filter_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            let pre: Vec<&str> = pre.split(' ').collect();
            let mut post = post.split(' ');
            let (fstype, _source, opts) = (post.next()?, post.next()?, post.next()?);
            let (root, point) = (*pre.get(3)?, *pre.get(4)?);
            match fstype {
                "cgroup2" => Some(Mount {
                    root,
                    point,
                    v2: true,
                }),
                "cgroup" if opts.split(',').any(|o| o == "memory") => Some(Mount {
                    root,
                    point,
                    v2: false,
                }),
                _ => None,
            }
        })
        .collect()
}

/// The smallest memory limit along this process's cgroup paths
/// (`/proc/self/cgroup` text) under the mounts `mountinfo` lists, each
/// limit file read through `read`; `None` where nothing limits it.
fn cgroup_limit(
    proc_cgroup: &str,
    mountinfo: &str,
    read: &dyn Fn(&Path) -> Option<String>,
) -> Option<CgroupLimit> {
    let mounts = memory_mounts(mountinfo);
    let mut best: Option<CgroupLimit> = None;
    for line in proc_cgroup.lines() {
        let mut f = line.splitn(3, ':');
        let (id, controllers, path) = (f.next()?, f.next()?, f.next()?);
        let v2 = id == "0" && controllers.is_empty();
        if !v2 && !controllers.split(',').any(|c| c == "memory") {
            continue;
        }
        for m in mounts.iter().filter(|m| m.v2 == v2) {
            // The process's path relative to what this mount shows: a
            // container's mount often has its own cgroup as the root.
            let rel = if m.root == "/" {
                path
            } else {
                path.strip_prefix(m.root).unwrap_or("/")
            };
            let file = if v2 {
                "memory.max"
            } else {
                "memory.limit_in_bytes"
            };
            let mut dir = PathBuf::from(m.point);
            let mut dirs = vec![dir.clone()];
            for part in rel.split('/').filter(|p| !p.is_empty()) {
                dir.push(part);
                dirs.push(dir.clone());
            }
            for d in dirs {
                let p = d.join(file);
                let Some(text) = read(&p) else { continue };
                let Ok(bytes) = text.trim().parse::<u64>() else {
                    continue; // "max": no limit at this level
                };
                if bytes < UNLIMITED && best.as_ref().is_none_or(|b| bytes < b.bytes) {
                    best = Some(CgroupLimit {
                        bytes,
                        file: p,
                        version: if v2 { "v2" } else { "v1" },
                    });
                }
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn reader(files: &[(&str, &str)]) -> impl Fn(&Path) -> Option<String> {
        let m: HashMap<PathBuf, String> = files
            .iter()
            .map(|(p, v)| (PathBuf::from(p), v.to_string()))
            .collect();
        move |p: &Path| m.get(p).cloned()
    }

    const V2_MOUNT: &str = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot\n";

    #[test]
    fn v2_takes_the_smallest_limit_along_the_path() {
        let pc = "0::/kubepods/pod1/ctr\n";
        let r = reader(&[
            ("/sys/fs/cgroup/memory.max", "max\n"),
            ("/sys/fs/cgroup/kubepods/memory.max", "68719476736\n"),
            ("/sys/fs/cgroup/kubepods/pod1/memory.max", "8589934592\n"),
            ("/sys/fs/cgroup/kubepods/pod1/ctr/memory.max", "max\n"),
        ]);
        let c = cgroup_limit(pc, V2_MOUNT, &r).unwrap();
        assert_eq!(c.bytes, 8 << 30);
        assert_eq!(c.version, "v2");
        assert_eq!(c.file, Path::new("/sys/fs/cgroup/kubepods/pod1/memory.max"));
    }

    #[test]
    fn a_container_mount_rooted_at_its_own_cgroup_reads_its_mount_point() {
        // Inside a container the mount's root is the container's cgroup
        // and /proc/self/cgroup shows that same path.
        let mi = "40 30 0:26 /docker/abc /sys/fs/cgroup ro - cgroup2 cgroup2 rw\n";
        let pc = "0::/docker/abc\n";
        let r = reader(&[("/sys/fs/cgroup/memory.max", "2147483648")]);
        assert_eq!(cgroup_limit(pc, mi, &r).unwrap().bytes, 2 << 30);
        // A namespaced view ("/") under the same mount reads the same file.
        assert_eq!(cgroup_limit("0::/\n", mi, &r).unwrap().bytes, 2 << 30);
    }

    #[test]
    fn v1_memory_controller_in_a_hybrid_layout() {
        let mi = concat!(
            "25 24 0:22 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n",
            "26 24 0:23 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n",
            "27 24 0:24 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n",
        );
        let pc = "4:memory:/svc/a\n1:cpu:/\n0::/\n";
        let r = reader(&[
            (
                "/sys/fs/cgroup/memory/memory.limit_in_bytes",
                "9223372036854771712",
            ),
            (
                "/sys/fs/cgroup/memory/svc/memory.limit_in_bytes",
                "9223372036854771712",
            ),
            (
                "/sys/fs/cgroup/memory/svc/a/memory.limit_in_bytes",
                "1073741824",
            ),
            // The v2 hierarchy has no memory controller here: no file.
        ]);
        let c = cgroup_limit(pc, mi, &r).unwrap();
        assert_eq!((c.bytes, c.version), (1 << 30, "v1"));
    }

    #[test]
    fn no_limit_anywhere_is_none() {
        let r = reader(&[("/sys/fs/cgroup/memory.max", "max")]);
        assert_eq!(cgroup_limit("0::/\n", V2_MOUNT, &r), None);
        // Nor without a memory mount at all.
        assert_eq!(cgroup_limit("0::/\n", "", &r), None);
    }

    #[test]
    fn the_budget_is_the_limit_less_the_weights_or_the_host_when_smaller() {
        let c = |bytes| CgroupLimit {
            bytes,
            file: PathBuf::from("/sys/fs/cgroup/memory.max"),
            version: "v2",
        };
        let b = MemoryBudget::choose(Some(c(8 << 30)), Some(100 << 30), 1 << 30).unwrap();
        assert_eq!(b.bytes, 7 << 30);
        assert!(b.source.starts_with("cgroup v2 limit"), "{}", b.source);
        let b = MemoryBudget::choose(Some(c(8 << 30)), Some(2 << 30), 1 << 30).unwrap();
        assert_eq!(b.bytes, 2 << 30);
        assert!(b.source.starts_with("host MemAvailable"), "{}", b.source);
        let b = MemoryBudget::choose(None, Some(3 << 30), 1 << 30).unwrap();
        assert_eq!((b.bytes, b.weights), (3 << 30, 0));
        let e = MemoryBudget::choose(Some(c(1 << 30)), Some(100 << 30), 1 << 30).unwrap_err();
        assert!(e.contains("does not hold the model"), "{e}");
    }
}
