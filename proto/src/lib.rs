//! faultline's wire protocol (`faultline/v1`): agent-to-agent check assignments, agent-to-
//! coordinator reports, and the CLI's run request, as tonic/prost code generated from
//! `proto/faultline/v1/peercheck.proto`; and `auth`, the shared-secret HMAC every request
//! carries.

#![forbid(unsafe_code)]

pub mod auth;

/// The generated messages and services.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod v1 {
    tonic::include_proto!("faultline.v1");
}

/// The protobuf package of every message and service.
pub const PACKAGE: &str = "faultline.v1";

/// The protocol version this build speaks (the `protocol` field of every request).
pub const PROTOCOL: u32 = 1;

/// The largest message a server accepts or a client sends (requests are small: names,
/// addresses, a few numbers; a run request lists at most a few thousand nodes).
pub const MAX_MESSAGE_BYTES: usize = 256 * 1024;
