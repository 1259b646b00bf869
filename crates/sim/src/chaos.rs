//! Faults drawn by the seed (`[chaos]` in a scenario): crashes with
//! restarts, partitions and clogs at random times and on random links,
//! bounded in count, so that every seed of a swarm explores another
//! interleaving instead of replaying the same fixed fault times.
//!
//! Drawn faults become ordinary [`FaultSection`]s before the run starts,
//! so a seed's faults are part of its replay. Partition and clog windows
//! of one kind never overlap (a `heal` or `unclog` ends every window of
//! its kind), and a crash never takes the last live node of a role, so
//! the cluster can always serve: every request must still end once.

use serde::Deserialize;

use crate::scenario::{FaultKind, FaultSection, Scenario};
use flotilla_exec::rng::Rng;

/// `[chaos]`: how many faults of each kind to draw, and their spans.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ChaosSection {
    /// Engine-node crashes.
    pub crashes: u32,
    /// Crashes of a pipeline group's later stage (`[pipeline]`): the
    /// group's node stays up and cannot serve until the stage is back.
    /// Restarts as crashes (`restart_fraction`, `restart_after_s`).
    pub stage_crashes: u32,
    /// Fraction of crashed nodes that restart (each after a delay drawn
    /// from `restart_after_s`).
    pub restart_fraction: f64,
    /// Delay from a crash to its restart, seconds (min, max).
    pub restart_after_s: (f64, f64),
    /// Partitions of a link that carries traffic (both ways, or one way
    /// with probability `one_way_fraction`).
    pub partitions: u32,
    /// Fraction of partitions that cut one direction only.
    pub one_way_fraction: f64,
    /// How long a partition lasts, seconds (min, max).
    pub partition_s: (f64, f64),
    /// Clogs of one direction of a link (messages held, then released).
    pub clogs: u32,
    /// Router crashes (`[topology] routers` above 1): a Router that is up,
    /// never the last one up; each restarts after `restart_after_s`.
    pub router_crashes: u32,
    /// Joins of `[topology] joiners` (one that is not in at that time);
    /// half of the joined nodes leave by draining after `stay_s`, the
    /// others stay. Joiners are not crashed by `crashes`.
    pub joins: u32,
    /// How long a joined node stays before it drains and leaves, seconds
    /// (min, max); half the joined nodes stay to the end.
    pub stay_s: (f64, f64),
    /// How long a clog lasts, seconds (min, max).
    pub clog_s: (f64, f64),
    /// Faults begin no earlier than this, seconds.
    pub from_s: f64,
    /// Faults begin before this, seconds (default: the run's duration).
    pub until_s: Option<f64>,
}

impl Default for ChaosSection {
    fn default() -> Self {
        ChaosSection {
            crashes: 0,
            stage_crashes: 0,
            restart_fraction: 0.75,
            restart_after_s: (0.5, 5.0),
            partitions: 0,
            one_way_fraction: 0.25,
            partition_s: (0.05, 2.0),
            clogs: 0,
            router_crashes: 0,
            joins: 0,
            stay_s: (2.0, 10.0),
            clog_s: (0.05, 1.0),
            from_s: 1.0,
            until_s: None,
        }
    }
}

/// Upper bound on drawn faults of each kind.
pub const CHAOS_FAULTS_MAX: u32 = 64;

impl ChaosSection {
    /// Refuses counts past the bound, empty or inverted spans, NaNs.
    pub fn validate(&self, duration_s: f64) -> Result<(), String> {
        for (n, name) in [
            (self.crashes, "crashes"),
            (self.stage_crashes, "stage_crashes"),
            (self.partitions, "partitions"),
            (self.clogs, "clogs"),
            (self.router_crashes, "router_crashes"),
            (self.joins, "joins"),
        ] {
            if n > CHAOS_FAULTS_MAX {
                return Err(format!("[chaos] {name} = {n}: at most {CHAOS_FAULTS_MAX}"));
            }
        }
        for (f, name) in [
            (self.restart_fraction, "restart_fraction"),
            (self.one_way_fraction, "one_way_fraction"),
        ] {
            if !(0.0..=1.0).contains(&f) {
                return Err(format!("[chaos] {name} = {f}: must be within 0..=1"));
            }
        }
        for ((lo, hi), name) in [
            (self.restart_after_s, "restart_after_s"),
            (self.partition_s, "partition_s"),
            (self.clog_s, "clog_s"),
            (self.stay_s, "stay_s"),
        ] {
            if !(lo.is_finite() && hi.is_finite() && lo > 0.0 && lo <= hi) {
                return Err(format!(
                    "[chaos] {name} = [{lo}, {hi}]: needs 0 < min <= max, finite"
                ));
            }
        }
        let until = self.until_s.unwrap_or(duration_s);
        if !(self.from_s.is_finite()
            && until.is_finite()
            && 0.0 <= self.from_s
            && self.from_s < until)
        {
            return Err(format!(
                "[chaos] from_s = {} and until_s = {until}: needs 0 <= from_s < until_s",
                self.from_s
            ));
        }
        Ok(())
    }

    /// Draws this seed's faults for `sc`, sorted by time.
    pub fn draw(&self, sc: &Scenario, rng: &mut Rng) -> Vec<FaultSection> {
        let until = self.until_s.unwrap_or(sc.run.duration_s);
        let span = until - self.from_s;
        let at = |rng: &mut Rng| self.from_s + rng.f64() * span;
        let within = |rng: &mut Rng, (lo, hi): (f64, f64)| lo + rng.f64() * (hi - lo);
        let mut out = Vec::new();

        // Joins first: a joiner is down until it joins, and after it
        // leaves, for the crashes below.
        let nodes = sc.engine_nodes() as u32;
        let mut down_until = vec![f64::NEG_INFINITY; nodes as usize + 1];
        // When each joiner is in: [join, leave) windows.
        let mut inside: Vec<Vec<(f64, f64)>> = vec![Vec::new(); nodes as usize + 1];
        let mut join_at: Vec<f64> = (0..self.joins).map(|_| at(rng)).collect();
        join_at.sort_by(f64::total_cmp);
        let joiners = sc.joiner_nodes();
        for t in join_at {
            let out_now: Vec<u32> = joiners
                .iter()
                .copied()
                .filter(|&n| {
                    inside[n as usize]
                        .iter()
                        .all(|&(a, b)| !(a <= t && t < b + 1.0))
                })
                .collect();
            if out_now.is_empty() {
                continue;
            }
            let node = out_now[rng.range(0, out_now.len() as u64 - 1) as usize];
            out.push(FaultSection {
                at_s: t,
                kind: FaultKind::Join { node },
            });
            let leave = if rng.chance(0.5) {
                let l = t + within(rng, self.stay_s);
                out.push(FaultSection {
                    at_s: l,
                    kind: FaultKind::Drain {
                        node,
                        grace_ms: 500,
                    },
                });
                l
            } else {
                f64::INFINITY
            };
            inside[node as usize].push((t, leave));
        }
        for &n in &joiners {
            // Down outside its windows: never a crash's "other node of
            // its role", and not crashed itself (a crash of a node that
            // is out changes nothing).
            down_until[n as usize] = f64::INFINITY;
        }

        // Crashes (of a node, or of one of its group's later stages): a
        // node that is up at that time, never the last of its role; some
        // restart later.
        let mut crash_at: Vec<(f64, bool)> = (0..self.crashes).map(|_| (at(rng), false)).collect();
        for _ in 0..self.stage_crashes {
            crash_at.push((at(rng), true));
        }
        crash_at.sort_by(|a, b| a.0.total_cmp(&b.0));
        // When each node is back up (INFINITY: never).
        for (t, of_stage) in crash_at {
            let up = |n: u32, down_until: &[f64]| down_until[n as usize] <= t;
            let candidates: Vec<u32> = (1..=nodes)
                .filter(|&n| up(n, &down_until))
                .filter(|&n| {
                    let role = sc.role_of(n);
                    (1..=nodes)
                        .filter(|&m| m != n && sc.role_of(m) == role && up(m, &down_until))
                        .count()
                        > 0
                })
                .collect();
            if candidates.is_empty() {
                continue;
            }
            let node = candidates[rng.range(0, candidates.len() as u64 - 1) as usize];
            let stage = if of_stage && sc.stages() > 1 {
                Some(rng.range(1, sc.stages() as u64 - 1) as usize)
            } else {
                None
            };
            out.push(FaultSection {
                at_s: t,
                kind: match stage {
                    Some(stage) => FaultKind::StageCrash { node, stage },
                    None => FaultKind::Crash { node },
                },
            });
            if rng.chance(self.restart_fraction) {
                let back = t + within(rng, self.restart_after_s);
                down_until[node as usize] = back;
                out.push(FaultSection {
                    at_s: back,
                    kind: match stage {
                        Some(stage) => FaultKind::StageRestart { node, stage },
                        None => FaultKind::Restart { node },
                    },
                });
            } else {
                down_until[node as usize] = f64::INFINITY;
            }
        }

        // Router crashes: one that is up, never the last one up; each comes
        // back (a front is restarted by its supervisor).
        let routers = sc.topology.routers;
        let mut router_at: Vec<f64> = (0..self.router_crashes).map(|_| at(rng)).collect();
        router_at.sort_by(f64::total_cmp);
        let mut router_back = vec![f64::NEG_INFINITY; routers];
        for t in router_at {
            let up: Vec<usize> = (0..routers).filter(|&r| router_back[r] <= t).collect();
            if up.len() < 2 {
                continue;
            }
            let router = up[rng.range(0, up.len() as u64 - 1) as usize];
            let back = t + within(rng, self.restart_after_s);
            router_back[router] = back;
            out.push(FaultSection {
                at_s: t,
                kind: FaultKind::RouterCrash { router },
            });
            out.push(FaultSection {
                at_s: back,
                kind: FaultKind::RouterRestart { router },
            });
        }

        // Links that carry traffic: each Router <-> every engine, and
        // prefill <-> decode (a cut between two mixed engines would hold
        // nothing).
        let mut links: Vec<(u32, u32)> = sc
            .router_nodes()
            .into_iter()
            .flat_map(|r| (1..=nodes).map(move |n| (r, n)))
            .collect();
        for p in 1..=nodes {
            for d in 1..=nodes {
                if sc.role_of(p) == flotilla_proto::Role::Prefill
                    && sc.role_of(d) == flotilla_proto::Role::Decode
                {
                    links.push((p, d));
                }
            }
        }
        let mut windows = |count: u32, len: (f64, f64), rng: &mut Rng, clog: bool| {
            let mut starts: Vec<f64> = (0..count).map(|_| at(rng)).collect();
            starts.sort_by(f64::total_cmp);
            let mut free_from = f64::NEG_INFINITY;
            for s in starts {
                // Windows of one kind do not overlap: the heal of one
                // would end the other early.
                let s = s.max(free_from);
                let e = s + within(rng, len);
                free_from = e + 0.001;
                let (mut a, mut b) = links[rng.range(0, links.len() as u64 - 1) as usize];
                if rng.chance(0.5) {
                    std::mem::swap(&mut a, &mut b);
                }
                let (begin, end) = if clog {
                    (FaultKind::Clog { a, b }, FaultKind::Unclog)
                } else {
                    let one_way = rng.chance(self.one_way_fraction);
                    (FaultKind::Partition { a, b, one_way }, FaultKind::Heal)
                };
                out.push(FaultSection {
                    at_s: s,
                    kind: begin,
                });
                out.push(FaultSection { at_s: e, kind: end });
            }
        };
        windows(self.partitions, self.partition_s, rng, false);
        windows(self.clogs, self.clog_s, rng, true);
        out.sort_by(|x, y| x.at_s.total_cmp(&y.at_s));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pd(chaos: &str) -> Scenario {
        Scenario::parse(&format!(
            r#"
[run]
duration_s = 30.0
[model]
preset = "llama3-8b"
[gpu]
preset = "a100"
[topology]
engines = 0
prefill = 2
decode = 2
[[tiers]]
name = "paid"

[[slos]]
tier = "paid"
ttft_ms = 1000
tpot_ms = 100
[[tenants]]
name = "app"
tier = "paid"

[[traffic]]
tenant = "app"
arrivals = {{ kind = "poisson", rate_per_s = 1.0 }}
prompt = {{ kind = "fixed", tokens = 64 }}
output = {{ kind = "fixed", tokens = 8 }}
[chaos]
{chaos}
"#
        ))
        .unwrap()
    }

    fn draw(sc: &Scenario, seed: u64) -> Vec<FaultSection> {
        sc.chaos.as_ref().unwrap().draw(sc, &mut Rng::new(seed))
    }

    #[test]
    fn a_seed_draws_the_same_faults_and_another_seed_others() {
        let sc = pd("crashes = 3\npartitions = 3\nclogs = 3");
        let key = |f: &[FaultSection]| format!("{f:?}");
        assert_eq!(key(&draw(&sc, 5)), key(&draw(&sc, 5)));
        assert_ne!(key(&draw(&sc, 5)), key(&draw(&sc, 6)));
    }

    #[test]
    fn crashes_never_take_the_last_live_node_of_a_role() {
        // Many crashes, no restarts: only one node of each role may die.
        let sc = pd("crashes = 20\nrestart_fraction = 0.0");
        for seed in 0..50 {
            let f = draw(&sc, seed);
            let crashed: Vec<u32> = f
                .iter()
                .filter_map(|x| match x.kind {
                    FaultKind::Crash { node } => Some(node),
                    _ => None,
                })
                .collect();
            assert_eq!(crashed.len(), 2, "seed {seed}: {f:?}");
            assert_ne!(
                sc.role_of(crashed[0]),
                sc.role_of(crashed[1]),
                "seed {seed}: two of one role died: {f:?}"
            );
        }
    }

    #[test]
    fn windows_of_a_kind_do_not_overlap_and_lie_in_the_run() {
        let sc = pd("partitions = 10\nclogs = 10\ncrashes = 4");
        for seed in 0..50 {
            let f = draw(&sc, seed);
            assert!(f.windows(2).all(|w| w[0].at_s <= w[1].at_s));
            let mut open_p = false;
            let mut open_c = false;
            let (mut np, mut nc) = (0, 0);
            for x in &f {
                assert!(x.at_s >= 1.0, "{x:?} before from_s");
                match x.kind {
                    FaultKind::Partition { a, b, .. } | FaultKind::Clog { a, b } => {
                        assert_ne!(a, b);
                        // Only links that carry traffic: one end the
                        // Router, or a prefill and a decode node.
                        let (ra, rb) = (sc.role_of(a), sc.role_of(b));
                        assert!(a == 0 || b == 0 || ra != rb, "{x:?}");
                        let open = if matches!(x.kind, FaultKind::Clog { .. }) {
                            nc += 1;
                            &mut open_c
                        } else {
                            np += 1;
                            &mut open_p
                        };
                        assert!(!*open, "seed {seed}: overlapping windows {f:?}");
                        *open = true;
                    }
                    FaultKind::Heal => open_p = false,
                    FaultKind::Unclog => open_c = false,
                    _ => {}
                }
            }
            assert_eq!((np, nc), (10, 10));
        }
    }

    #[test]
    fn bad_chaos_sections_are_refused() {
        for (bad, why) in [
            ("crashes = 65", "at most 64"),
            ("restart_fraction = 1.5", "within 0..=1"),
            ("clog_s = [2.0, 1.0]", "min <= max"),
            ("partition_s = [0.0, 1.0]", "0 < min"),
            ("from_s = 40.0", "from_s < until_s"),
        ] {
            let text = format!(
                "[run]\nduration_s = 30.0\n[model]\npreset = \"llama3-8b\"\n[gpu]\npreset = \"a100\"\n\
                 [[tiers]]\nname = \"paid\"\n[[slos]]\ntier = \"paid\"\nttft_ms = 1000\ntpot_ms = 100\n\
                 [[tenants]]\nname = \"app\"\ntier = \"paid\"\n[[traffic]]\ntenant = \"app\"\n\
                 arrivals = {{ kind = \"poisson\", rate_per_s = 1.0 }}\n\
                 prompt = {{ kind = \"fixed\", tokens = 64 }}\noutput = {{ kind = \"fixed\", tokens = 8 }}\n\
                 [chaos]\n{bad}\n"
            );
            let e = Scenario::parse(&text).unwrap_err().to_string();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
