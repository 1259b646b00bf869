//! Cluster.
