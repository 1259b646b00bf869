//! Deterministic cluster simulation: the same Router, Scheduler and
//! GpuWorker actors that serve real traffic, in one thread under a paused
//! clock, over a simulated network with faults, with a GPU cost model in
//! place of the forward pass. `flotilla simulate SCENARIO --seed N` runs a
//! scenario file from `simulations/`; the same scenario and seed give the
//! same trace hash.

pub mod chaos;
pub mod cost;
pub mod exec;
pub mod run;
pub mod scenario;
pub mod swarm;

pub use run::{Report, SimError, TenantReport, TierReport, run};
pub use scenario::Scenario;
pub use swarm::{SeedResult, SwarmReport, SwarmTotals, swarm};
