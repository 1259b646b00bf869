//! Deterministic cluster simulation: the same Router, Scheduler and
//! GpuWorker actors that serve real traffic, in one thread under a paused
//! clock, over a simulated network with faults, with a GPU cost model in
//! place of the forward pass. `flotilla simulate SCENARIO --seed N` runs a
//! scenario file from `simulations/`; the same scenario and seed give the
//! same trace hash.

pub mod chaos;
pub mod compare;
pub mod cost;
pub mod exec;
pub mod plan;
pub mod run;
pub mod scenario;
pub mod swarm;

pub use compare::{Comparison, compare};
pub use run::{End, Report, RequestRecord, SimError, TenantReport, TierReport, run};
pub use scenario::{Scenario, SimMode};
pub use swarm::{SeedResult, SwarmReport, SwarmTotals, swarm};
