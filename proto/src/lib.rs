//! faultline's wire protocol (`faultline/v1`): agent-to-agent check rendezvous and results,
//! agent-to-coordinator reports, and the CLI's check request.
//!
//! The `.proto` files live in `proto/faultline/v1/` and are compiled with tonic/prost by the
//! peer-check work (issue 6). Until then this crate only fixes the package name, so other crates
//! can depend on it and the workspace layout is the final one.

#![forbid(unsafe_code)]

/// The protobuf package of every message and service.
pub const PACKAGE: &str = "faultline.v1";
