//! The generated PeerCheck service over a real tonic server on loopback: a signed request is
//! served; an unsigned, forged or oversized one is refused with a clear status, and the server
//! keeps serving.

#![allow(clippy::unwrap_used)]

use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use faultline_proto::auth::{sign, Key, Verifier, NONCE_BYTES};
use faultline_proto::v1::peer_check_client::PeerCheckClient;
use faultline_proto::v1::peer_check_server::{PeerCheck, PeerCheckServer};
use faultline_proto::v1::{
    CheckAccepted, CheckAssignment, PingReply, PingRequest, ReportAck, RunConclusion,
};
use faultline_proto::{MAX_MESSAGE_BYTES, PROTOCOL};
use tonic::{Code, Request, Response, Status};

const SECRET: &[u8] = b"test secret, thirty-two bytes...";

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

struct Agent {
    verifier: Mutex<Verifier>,
}

#[tonic::async_trait]
impl PeerCheck for Agent {
    async fn ping(&self, _: Request<PingRequest>) -> Result<Response<PingReply>, Status> {
        Err(Status::unimplemented("not used by this test"))
    }
    async fn cancel(&self, _: Request<CheckAssignment>) -> Result<Response<CheckAccepted>, Status> {
        Err(Status::unimplemented("not used by this test"))
    }
    async fn conclude(&self, _: Request<RunConclusion>) -> Result<Response<ReportAck>, Status> {
        Err(Status::unimplemented("not used by this test"))
    }
    async fn forward(
        &self,
        _: Request<faultline_proto::v1::ForwardRequest>,
    ) -> Result<Response<faultline_proto::v1::ForwardReply>, Status> {
        Err(Status::unimplemented("not used by this test"))
    }
    async fn assign(
        &self,
        request: Request<CheckAssignment>,
    ) -> Result<Response<CheckAccepted>, Status> {
        let a = request.into_inner();
        let sender = self
            .verifier
            .lock()
            .unwrap()
            .verify(&a, now_ms())
            .map_err(|e| Status::unauthenticated(e.to_string()))?;
        if a.protocol != PROTOCOL {
            return Ok(Response::new(CheckAccepted {
                accepted: false,
                reason: format!("protocol {} (this agent speaks {PROTOCOL})", a.protocol),
            }));
        }
        Ok(Response::new(CheckAccepted {
            accepted: true,
            reason: format!("from {sender}"),
        }))
    }
}

#[tokio::test]
async fn signed_requests_are_served_and_others_refused() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let agent = Agent {
        verifier: Mutex::new(Verifier::new(
            Key::new(SECRET).unwrap(),
            Duration::from_secs(30),
            "agent-1",
        )),
    };
    let server = PeerCheckServer::new(agent).max_decoding_message_size(MAX_MESSAGE_BYTES);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(server)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let mut client = loop {
        match PeerCheckClient::connect(format!("http://{addr}")).await {
            Ok(c) => break c,
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    };
    let key = Key::new(SECRET).unwrap();
    let request = |run: &str| CheckAssignment {
        protocol: PROTOCOL,
        run_id: run.into(),
        round: 1,
        bytes: 64 << 20,
        iterations: 5,
        timeout_ms: 10_000,
        ..Default::default()
    };

    let mut ok = request("run-1");
    sign(
        &mut ok,
        &key,
        "coordinator-node",
        "agent-1",
        now_ms(),
        [1; NONCE_BYTES],
    );
    let r = client.assign(ok.clone()).await.unwrap().into_inner();
    assert!(r.accepted, "{r:?}");
    assert_eq!(r.reason, "from coordinator-node");

    // The same request again: a replay.
    let e = client.assign(ok).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    assert!(e.message().contains("replay"), "{}", e.message());

    // Unsigned, and signed with the wrong secret.
    let e = client.assign(request("run-2")).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    assert!(e.message().contains("not signed"), "{}", e.message());
    let mut forged = request("run-3");
    sign(
        &mut forged,
        &Key::new(b"somebody else's secret, 32 bytes").unwrap(),
        "coordinator-node",
        "agent-1",
        now_ms(),
        [2; NONCE_BYTES],
    );
    let e = client.assign(forged).await.unwrap_err();
    assert!(e.message().contains("does not verify"), "{}", e.message());

    // Over the size bound: refused before any handler runs.
    let mut big = request(&"x".repeat(MAX_MESSAGE_BYTES + 1));
    sign(
        &mut big,
        &key,
        "coordinator-node",
        "agent-1",
        now_ms(),
        [3; NONCE_BYTES],
    );
    let e = client.assign(big).await.unwrap_err();
    assert_eq!(e.code(), Code::OutOfRange, "{e:?}");

    // An older protocol is a clear refusal, not an error.
    let mut older = request("run-4");
    older.protocol = PROTOCOL + 1;
    sign(
        &mut older,
        &key,
        "coordinator-node",
        "agent-1",
        now_ms(),
        [4; NONCE_BYTES],
    );
    let r = client.assign(older).await.unwrap().into_inner();
    assert!(!r.accepted && r.reason.contains("protocol"), "{r:?}");

    // Still serving.
    let mut again = request("run-5");
    sign(
        &mut again,
        &key,
        "coordinator-node",
        "agent-1",
        now_ms(),
        [5; NONCE_BYTES],
    );
    assert!(client.assign(again).await.unwrap().into_inner().accepted);
}
