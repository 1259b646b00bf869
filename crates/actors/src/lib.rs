//! The engine's actors on `ractor`: a Scheduler actor that owns the
//! scheduler state machine (tier queues, admission, the KV block pool, the
//! batch plan) and a GpuWorker actor that owns one executor and runs the
//! steps it is sent. Both are thin shells: every decision is made in
//! `flotilla-sched` / `flotilla-kv`; the shells only move messages, read the
//! injected [`Clock`] and record metrics.
//!
//! On one node the KvBlockPool is a state machine owned by the Scheduler
//! actor, not an actor of its own: each step's plan needs a synchronous
//! answer for every block it allocates, and an actor round trip per
//! allocation would sit on the critical path of every step. The block
//! migration protocol of disaggregated serving (issue 5) is where a
//! KvBlockPool actor earns its mailbox.

mod draft;
mod engine;
mod msg;
mod trace;
mod worker;

#[cfg(test)]
mod draft_tests;
#[cfg(test)]
mod tests;

pub use engine::{EngineOptions, EngineStartError, InvariantHook, LocalEngine, spawn_engine};

use std::time::Duration;

/// Whether the actors run on a multi-thread runtime (a server), where CPU
/// work can leave this thread, rather than a current-thread one (the
/// simulator), where nothing runs beside anything.
fn on_multi_thread_runtime() -> bool {
    tokio::runtime::Handle::current().runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread
}

/// Where the actors read time: the monotonic clock in production, the
/// simulator's clock under simulation.
pub trait Clock: Send + Sync + 'static {
    /// Time since an origin the clock chooses; never goes backwards.
    fn now(&self) -> Duration;
}
