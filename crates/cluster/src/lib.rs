//! Engines across nodes. The Router's side is [`ClusterEngine`], an
//! [`flotilla_engine::Engine`] whose requests run on engine nodes: an actor
//! around [`RouterCore`], the Router's state machine; the engine node's
//! side is [`run_worker`], an actor around [`NodeCore`], the node's state
//! machine, which feeds what arrives to the node's own engine. Both speak
//! only through a [`flotilla_transport::Transport`], so the same code runs
//! over QUIC and over the simulated network. The cores are their own crate
//! (`flotilla-cores`: no clock, no runtime, no I/O); these shells own the
//! clock, the transport, the tasks and the hooks.

pub mod router;
mod settings;
pub mod worker;

pub use flotilla_cores::node::{
    EngineAnswer, EngineCall, NodeCore, NodeInput, NodeOutput, NodeSettings,
};
pub use flotilla_cores::router::{Reach, RouterCore, RouterInput, RouterOptions, RouterOutput};
pub use router::{CheckHook, ClusterEngine, Connect, RouterHooks, RouterStep};
pub use settings::{node_settings, router_options};
pub use worker::{NodeStep, OrphanHook, WorkerEnd, WorkerOptions, run_worker};

/// Collects what a shell hands it, in order (a test's record of every
/// input a core handled).
#[derive(Clone, Debug)]
pub struct Recorder<T>(std::sync::Arc<std::sync::Mutex<Vec<T>>>);

impl<T> Default for Recorder<T> {
    fn default() -> Self {
        Recorder(std::sync::Arc::default())
    }
}

impl<T: Clone> Recorder<T> {
    /// Appends one.
    pub fn push(&self, t: T) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(t);
    }

    /// Everything so far.
    pub fn take(&self) -> Vec<T> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

#[cfg(test)]
mod pd_tests;
#[cfg(test)]
mod routers_tests;
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
    use flotilla_proto::wire::Message;
    // Each is sent again by itself (a heartbeat next interval, a prefix
    // report as the whole next heartbeat).
    if matches!(
        msg,
        Message::Heartbeat(_) | Message::Prefix { .. } | Message::PrefixResync
    ) {
        tracing::debug!("{:?} to node {to} not delivered: {reason}", msg.kind());
    } else {
        tracing::warn!("{:?} to node {to} not delivered: {reason}", msg.kind());
    }
}
