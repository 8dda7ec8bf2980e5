//! Tests of `manifests/`: the kustomize base, the examples, and their agreement with the agent.
//!
//! One test binary (the modules below) so that k8s-openapi is linked once.

mod admission;
mod common;
mod coordinator;
mod daemonset;
mod examples;
mod image;
mod kustomize;
mod memory;
mod monitoring;
mod networkpolicy;
mod policy;
mod rbac;
mod schema;

/// The agent's table of Kubernetes API calls, shared as source (no dependency on the agent
/// crate): `rbac.rs` checks the RBAC manifests against it.
#[path = "../../../agent/src/sink/kube/calls.rs"]
#[allow(dead_code)] // `listed` is for the agent's own tests
#[rustfmt::skip] // formatted as part of the agent crate
mod calls;
