//! `faultline-manifests`: tests of the Kubernetes manifests in `manifests/` (no library code).
//!
//! The tests live in `tests/`: every document parses into its Kubernetes type with no unknown
//! field, the kustomization is complete, the RBAC rules match the agent's and the coordinator's
//! API call tables (`agent/src/sink/kube/calls.rs`) in both directions, the DaemonSet, the
//! coordinator's Deployment and the examples have the properties docs/kubernetes.md promises, and the admission policy's CEL expressions
//! allow and deny what they should on handmade admission requests.
