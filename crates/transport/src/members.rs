//! Who a node lets in: the config's nodes, nodes that join at run time
//! (certificates the cluster CA signed for a name not in the config), and
//! never a revoked certificate.
//!
//! A node that joins gets the id [`flotilla_proto::joined_node_id`] of its
//! name, so every node gives it the same one without asking anyone. Only
//! engine roles join; Routers and pipeline stages are declared in the
//! config. The revocation list is a file of node names and certificate
//! serial numbers (one per line, `#` starts a comment); it is read again
//! whenever it changes, and a connected peer it now names is cut off.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::SystemTime;

use flotilla_proto::{NodeId, Role, joined_node_id};

use crate::quic::PeerSpec;

/// Who may join a node's cluster at run time.
#[derive(Clone, Debug, Default)]
pub struct JoinPolicy {
    /// Accept engine nodes (worker, prefill, decode) that are not in the
    /// config, when their certificate chains to the cluster CA.
    pub accept: bool,
    /// The revocation list, if the config names one.
    pub revoked: Option<PathBuf>,
}

/// Why a peer's connection was refused; its `Display` is the log line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The TLS handshake failed: no certificate, or one another CA signed.
    Handshake(String),
    /// The certificate is named in the revocation list.
    Revoked {
        /// The certificate's node name.
        name: String,
        /// Its serial number.
        serial: String,
        /// The list.
        list: PathBuf,
    },
    /// A config node whose certificate carries another role.
    WrongRole {
        /// Node name.
        name: String,
        /// Role in its certificate.
        cert: Role,
        /// Role in the config.
        config: Role,
    },
    /// A node not in the config whose role may not join at run time.
    RoleMayNotJoin {
        /// Node name.
        name: String,
        /// Role in its certificate.
        role: Role,
    },
    /// A node not in the config, on a node that takes no joiners.
    NotInConfig {
        /// Node name.
        name: String,
    },
    /// Its name hashes to the id of a node already joined under another.
    IdTaken {
        /// Node name.
        name: String,
        /// The node that holds the id.
        holder: String,
    },
    /// A certificate with this node's own name.
    IsSelf {
        /// Node name.
        name: String,
    },
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::Handshake(e) => write!(
                f,
                "TLS handshake failed ({e}): no client certificate, or one not signed by this \
                 cluster's CA"
            ),
            Refusal::Revoked { name, serial, list } => write!(
                f,
                "certificate of {name} (serial {serial}) is revoked by {}",
                list.display()
            ),
            Refusal::WrongRole { name, cert, config } => write!(
                f,
                "certificate of {name} carries role {cert}; the config says {config}"
            ),
            Refusal::RoleMayNotJoin { name, role } => write!(
                f,
                "{name} ({role}) is not in the config and a {role} may not join at run time \
                 (only worker, prefill and decode nodes join; routers and pipeline stages are \
                 declared in [[nodes]])"
            ),
            Refusal::NotInConfig { name } => write!(
                f,
                "{name} is not in the config and this node takes no nodes that join at run time"
            ),
            Refusal::IdTaken { name, holder } => write!(
                f,
                "{name} hashes to the node id of {holder}, which joined first: rename one"
            ),
            Refusal::IsSelf { name } => write!(f, "a peer presents this node's own name {name}"),
        }
    }
}

/// A peer admitted: its id and role, and whether it joined at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Admitted {
    /// Its node id.
    pub node: NodeId,
    /// Its role.
    pub role: Role,
    /// Not in the config.
    pub joined: bool,
}

/// Decides whether a verified certificate (`name`, `role`, `serial`) may
/// talk to this node: `nodes` are the config's (index = id), `me` this
/// node's id, `joined` the names of the nodes that joined so far, by id.
#[allow(clippy::too_many_arguments)]
pub fn admit(
    name: &str,
    role: Role,
    serial: &str,
    nodes: &[PeerSpec],
    me: NodeId,
    policy: &JoinPolicy,
    revoked: &Revocations,
    joined: &BTreeMap<NodeId, String>,
) -> Result<Admitted, Refusal> {
    if let Some(list) = revoked.names(name, serial) {
        return Err(Refusal::Revoked {
            name: name.to_owned(),
            serial: serial.to_owned(),
            list,
        });
    }
    if let Some(i) = nodes.iter().position(|n| n.name == name) {
        let spec = &nodes[i];
        if i as NodeId == me {
            return Err(Refusal::IsSelf {
                name: name.to_owned(),
            });
        }
        if spec.role != role {
            return Err(Refusal::WrongRole {
                name: name.to_owned(),
                cert: role,
                config: spec.role,
            });
        }
        return Ok(Admitted {
            node: i as NodeId,
            role,
            joined: false,
        });
    }
    if !policy.accept {
        return Err(Refusal::NotInConfig {
            name: name.to_owned(),
        });
    }
    if !matches!(role, Role::Worker | Role::Prefill | Role::Decode) {
        return Err(Refusal::RoleMayNotJoin {
            name: name.to_owned(),
            role,
        });
    }
    let node = joined_node_id(name);
    if node == me {
        return Err(Refusal::IsSelf {
            name: name.to_owned(),
        });
    }
    if let Some(holder) = joined.get(&node)
        && holder != name
    {
        return Err(Refusal::IdTaken {
            name: name.to_owned(),
            holder: holder.clone(),
        });
    }
    Ok(Admitted {
        node,
        role,
        joined: true,
    })
}

/// The revocation list, read again when its file changes.
#[derive(Debug, Default)]
pub struct Revocations {
    path: Option<PathBuf>,
    state: Mutex<Loaded>,
}

#[derive(Debug, Default)]
struct Loaded {
    /// The file's modification time and length when read.
    stamp: Option<(SystemTime, u64)>,
    entries: BTreeSet<String>,
    /// One more each time the entries changed.
    generation: u64,
}

impl Revocations {
    /// The list at `path` (none: nothing is revoked), read now.
    pub fn new(path: Option<PathBuf>) -> Revocations {
        let r = Revocations {
            path,
            state: Mutex::new(Loaded::default()),
        };
        r.refresh();
        r
    }

    /// Reads the file again if it changed since the last read; true if it
    /// did. A missing or unreadable file revokes nothing, and says so.
    pub fn refresh(&self) -> bool {
        let Some(path) = &self.path else {
            return false;
        };
        let stamp = std::fs::metadata(path)
            .ok()
            .and_then(|m| Some((m.modified().ok()?, m.len())));
        let mut st = self.state.lock().expect("revocations poisoned");
        if stamp == st.stamp && (stamp.is_some() || st.entries.is_empty()) {
            return false;
        }
        let entries = match std::fs::read_to_string(path) {
            Ok(text) => parse(&text),
            Err(e) => {
                tracing::warn!(
                    "revocation list {}: {e}; nothing is revoked until it can be read",
                    path.display()
                );
                BTreeSet::new()
            }
        };
        let changed = entries != st.entries;
        if changed {
            tracing::info!(
                "revocation list {}: {} entries",
                path.display(),
                entries.len()
            );
        }
        st.stamp = stamp;
        st.entries = entries;
        st.generation += u64::from(changed);
        changed
    }

    /// How many times the entries changed since start: a watcher compares
    /// it with the last it acted on (whoever read the file first).
    pub fn generation(&self) -> u64 {
        self.state.lock().expect("revocations poisoned").generation
    }

    /// The list's path if it names the node `name` or the serial `serial`.
    pub fn names(&self, name: &str, serial: &str) -> Option<PathBuf> {
        let st = self.state.lock().expect("revocations poisoned");
        let hit = st.entries.contains(name) || st.entries.contains(&normalize_serial(serial));
        hit.then(|| self.path.clone().unwrap_or_default())
    }
}

/// Lines of names and serials; `#` starts a comment.
fn parse(text: &str) -> BTreeSet<String> {
    text.lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
        .flat_map(|l| {
            // A serial (hex, maybe with colons) also matches as written.
            let serial = l.chars().all(|c| c.is_ascii_hexdigit() || c == ':');
            [Some(l.to_owned()), serial.then(|| normalize_serial(l))]
        })
        .flatten()
        .collect()
}

/// Serials compare as lower-case hex without separators.
pub fn normalize_serial(s: &str) -> String {
    s.chars()
        .filter(|c| c.is_ascii_hexdigit())
        .map(|c| c.to_ascii_lowercase())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes() -> Vec<PeerSpec> {
        [("router", Role::Router), ("worker-1", Role::Worker)]
            .iter()
            .map(|(n, r)| PeerSpec {
                name: n.to_string(),
                role: *r,
                addr: "127.0.0.1:1".into(),
            })
            .collect()
    }

    fn open() -> JoinPolicy {
        JoinPolicy {
            accept: true,
            revoked: None,
        }
    }

    #[test]
    fn config_nodes_keep_their_index_and_joiners_get_their_name_s_id() {
        let none = Revocations::new(None);
        let j = BTreeMap::new();
        let a = admit(
            "worker-1",
            Role::Worker,
            "01",
            &nodes(),
            0,
            &open(),
            &none,
            &j,
        );
        assert_eq!(
            a,
            Ok(Admitted {
                node: 1,
                role: Role::Worker,
                joined: false
            })
        );
        let a = admit(
            "worker-9",
            Role::Worker,
            "02",
            &nodes(),
            0,
            &open(),
            &none,
            &j,
        )
        .unwrap();
        assert_eq!(a.node, joined_node_id("worker-9"));
        assert!(a.joined);
        // The same name again (a reconnect, a restart) is the same node.
        let j = BTreeMap::from([(a.node, "worker-9".to_string())]);
        assert_eq!(
            admit(
                "worker-9",
                Role::Worker,
                "03",
                &nodes(),
                0,
                &open(),
                &none,
                &j
            ),
            Ok(a)
        );
    }

    #[test]
    fn each_refusal_names_its_reason() {
        let none = Revocations::new(None);
        let j = BTreeMap::new();
        let refuse = |name: &str, role, policy: &JoinPolicy, me, j: &BTreeMap<NodeId, String>| {
            admit(name, role, "0a", &nodes(), me, policy, &none, j)
                .unwrap_err()
                .to_string()
        };
        let why = refuse("worker-1", Role::Prefill, &open(), 0, &j);
        assert!(
            why.contains("carries role prefill; the config says worker"),
            "{why}"
        );
        let why = refuse("router-2", Role::Router, &open(), 1, &j);
        assert!(why.contains("a router may not join at run time"), "{why}");
        let why = refuse("worker-9", Role::Worker, &JoinPolicy::default(), 1, &j);
        assert!(why.contains("takes no nodes that join"), "{why}");
        let why = refuse("router", Role::Router, &open(), 0, &j);
        assert!(why.contains("own name"), "{why}");
        let taken = BTreeMap::from([(joined_node_id("worker-9"), "worker-x".to_string())]);
        let why = refuse("worker-9", Role::Worker, &open(), 0, &taken);
        assert!(why.contains("hashes to the node id of worker-x"), "{why}");
    }

    #[test]
    fn the_revocation_list_is_read_again_when_it_changes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("revoked.txt");
        std::fs::write(&path, "# revoked nodes\nworker-7\n").unwrap();
        let r = Revocations::new(Some(path.clone()));
        let j = BTreeMap::new();
        let why = admit("worker-7", Role::Worker, "0b", &nodes(), 0, &open(), &r, &j)
            .unwrap_err()
            .to_string();
        assert!(
            why.contains("certificate of worker-7 (serial 0b) is revoked by"),
            "{why}"
        );
        assert!(
            admit(
                "worker-8",
                Role::Worker,
                "1f:2e",
                &nodes(),
                0,
                &open(),
                &r,
                &j
            )
            .is_ok()
        );
        assert!(!r.refresh(), "unchanged: not read again");
        // A serial, written as `certs issue` prints it; the file grows, so
        // its stamp changes even within the clock's resolution.
        std::fs::write(&path, "worker-7\n1F:2E:00:11:22:33:44:55:66  # stolen\n").unwrap();
        assert!(r.refresh());
        let why = admit(
            "worker-8",
            Role::Worker,
            "1f:2e:00:11:22:33:44:55:66",
            &nodes(),
            0,
            &open(),
            &r,
            &j,
        )
        .unwrap_err()
        .to_string();
        assert!(why.contains("revoked"), "{why}");
        // A config node is revoked as surely as a joiner.
        std::fs::write(&path, "worker-1\n").unwrap();
        assert!(r.refresh());
        assert!(admit("worker-1", Role::Worker, "0c", &nodes(), 0, &open(), &r, &j).is_err());
        assert!(
            admit(
                "worker-8",
                Role::Worker,
                "1f:2e:00:11:22:33:44:55:66",
                &nodes(),
                0,
                &open(),
                &r,
                &j
            )
            .is_ok()
        );
    }
}
