//! The cluster's decisions as state machines: [`RouterCore`], the Router's
//! (membership, routing, re-runs and moves, event order, drains), and
//! [`NodeCore`], an engine node's (its Router links, decode imports,
//! prefill exports, drain). Each takes one input and the time and appends
//! outputs; it does no I/O, reads no clock, waits for nothing and spawns
//! nothing, and everything it knows arrives as an input: the time, the
//! messages, the engine's answers, which peers the transport can reach
//! ([`Reach`]). So a recorded input sequence replays a core to the same
//! outputs, and the simulator runs the very code a cluster runs.
//!
//! The build holds them to it: this crate depends on plain data only
//! (`flotilla-proto`, `flotilla-exec`'s types), and its `clippy.toml`
//! bans clocks, sleeps, threads and self-seeded hashing. The actors that
//! carry the outputs out (the shells, in `flotilla-cluster`) own the clock,
//! the transport, the tasks and the hooks.

pub mod node;
pub mod prefix;
pub mod router;

pub use flotilla_proto::NodeId;
pub use node::{
    EngineAnswer, EngineCall, NodeCore, NodeInput, NodeOutput, NodeSettings, TransferSpan,
};
pub use router::{Reach, RouterCore, RouterInput, RouterOptions, RouterOutput};

#[cfg(test)]
mod testrig;
