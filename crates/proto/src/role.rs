//! What a node is for. A node's role is written into its certificate by the
//! cluster CA and decides which message kinds it may send.

use std::fmt;
use std::str::FromStr;

/// A node's role in the cluster.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize,
)]
pub enum Role {
    /// Runs the HTTP front and routes requests to workers.
    Router,
    /// Runs a whole engine (prefill and decode); `mixed` in configs is the same.
    Worker,
    /// Runs prompts only and hands their KV blocks to a decode node.
    Prefill,
    /// Continues requests whose KV blocks came from a prefill node.
    Decode,
}

impl Role {
    /// Every role, in a fixed order.
    pub const ALL: [Role; 4] = [Role::Router, Role::Worker, Role::Prefill, Role::Decode];

    /// The name used in configs, certificates and flags.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Router => "router",
            Role::Worker => "worker",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }

    /// Whether this node runs an engine (anything but the router).
    pub fn runs_engine(self) -> bool {
        self != Role::Router
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Role, String> {
        match s {
            "router" => Ok(Role::Router),
            "worker" | "mixed" => Ok(Role::Worker),
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            _ => Err(format!(
                "unknown role '{s}' (expected router, worker, mixed, prefill or decode)"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_mixed_is_worker() {
        for r in Role::ALL {
            assert_eq!(r.as_str().parse::<Role>(), Ok(r));
        }
        assert_eq!("mixed".parse::<Role>(), Ok(Role::Worker));
        assert!(
            "gpu"
                .parse::<Role>()
                .unwrap_err()
                .contains("unknown role 'gpu'")
        );
    }
}
