//! Engines across nodes. The Router's side is [`ClusterEngine`], an
//! [`flotilla_engine::Engine`] whose requests run on engine nodes: an actor
//! around [`RouterCore`], the Router's state machine; the engine node's
//! side is [`run_worker`], an actor around [`NodeCore`], the node's state
//! machine, which feeds what arrives to the node's own engine. Both speak
//! only through a [`flotilla_transport::Transport`], so the same code runs
//! over QUIC and over the simulated network. The cores read no clock and
//! spawn nothing (`clippy.toml`); the actors around them do both.

pub mod memnet;
pub mod prefix;
pub mod router;
pub mod worker;

pub use router::{CheckHook, ClusterEngine, RouterCore, RouterInput, RouterOptions, RouterOutput};
pub use worker::{
    EngineAnswer, EngineCall, NodeCore, NodeInput, NodeOutput, OrphanHook, WorkerEnd,
    WorkerOptions, run_worker,
};

#[cfg(test)]
mod pd_tests;
#[cfg(test)]
mod testrig;
#[cfg(test)]
mod tests;

/// Logs a control message the transport did not deliver: a heartbeat to a
/// peer that is not up (routine while nodes start or after one died) at
/// debug, anything else as a warning.
pub(crate) fn log_undelivered(
    to: flotilla_transport::NodeId,
    msg: &flotilla_proto::wire::Message,
    reason: &dyn std::fmt::Display,
) {
    if matches!(msg, flotilla_proto::wire::Message::Heartbeat(_)) {
        tracing::debug!("heartbeat to node {to} not delivered: {reason}");
    } else {
        tracing::warn!("{:?} to node {to} not delivered: {reason}", msg.kind());
    }
}
