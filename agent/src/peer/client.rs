//! The gRPC client side that agents and the coordinator share: a channel's endpoint for an
//! `ip:port` (`endpoint`), a request whose deadline the server learns (`timed`), the bearer
//! header (`bearer`), one call with its deadline also enforced here (`within`), and why a call
//! got no answer (`CallError`). The timeouts of the calls on the peer-check control path are
//! here too, so that the coordinator and the agents (as members and as relays) agree on them.

use std::time::Duration;

use tonic::transport::Endpoint;
use tonic::{Request, Response, Status};

use super::wire;

/// Connect and call timeouts of the small calls (ping, assign, cancel, report).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a call through a relay may take: the relay's call onward (a conclusion's is the
/// longest).
pub const FORWARD_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a conclusion may take to deliver.
pub const CONCLUDE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a call to another agent or to the coordinator got no answer.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("bad address {address:?}: {source}")]
    BadAddress {
        address: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("cannot reach the coordinator at {address}: {source}")]
    Connect {
        address: String,
        #[source]
        source: tonic::transport::Error,
    },
    /// The connection failed (a caller that names the address itself).
    #[error(transparent)]
    Transport(tonic::transport::Error),
    #[error("the token is not a valid header value")]
    Token,
    /// The receiver's answer was an error status (its message, as the receiver wrote it).
    #[error("{}", .0.message())]
    Answer(#[source] Status),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("a report goes to the coordinator")]
    ReportToMember,
    #[error(transparent)]
    Sign(#[from] wire::SecretError),
}

/// A client endpoint for `address` (`ip:port`).
pub fn endpoint(address: &str) -> Result<Endpoint, CallError> {
    Endpoint::from_shared(format!("http://{address}"))
        .map(|e| e.connect_timeout(CALL_TIMEOUT).tcp_nodelay(true))
        .map_err(|source| CallError::BadAddress {
            address: address.to_string(),
            source,
        })
}

/// A request with a deadline the server learns (`grpc-timeout`).
pub fn timed<T>(msg: T, timeout: Duration) -> Request<T> {
    let mut r = Request::new(msg);
    r.set_timeout(timeout);
    r
}

/// Adds `authorization: Bearer <token>`.
pub fn bearer<T>(r: &mut Request<T>, token: &str) -> Result<(), CallError> {
    let value = format!("Bearer {token}")
        .parse()
        .map_err(|_| CallError::Token)?;
    r.metadata_mut().insert("authorization", value);
    Ok(())
}

/// One call with a deadline (`call` gets it to send to the server; it is also enforced here in
/// case the server never answers): the answer, or why there is none.
pub async fn within<T, F>(
    timeout: Duration,
    call: impl FnOnce(Duration) -> F,
) -> Result<T, CallError>
where
    F: std::future::Future<Output = Result<Response<T>, Status>>,
{
    match tokio::time::timeout(timeout, call(timeout)).await {
        Ok(Ok(r)) => Ok(r.into_inner()),
        Ok(Err(s)) => Err(CallError::Answer(s)),
        Err(_) => Err(CallError::Timeout(timeout)),
    }
}
