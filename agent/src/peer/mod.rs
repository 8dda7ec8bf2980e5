//! Peer-paired collective checks: agents check each other in pairs and the coordinator locates
//! faulty nodes, broken links and stragglers from the results. `pairing` is the pure core (the
//! planner and its verdicts, plus a simulator for tests and benchmarks); `runner` runs the probe
//! as a child process with a hard deadline; `verdicts` turns a run's verdicts into this node's
//! fault record (`PEER_UNREACHABLE`, `PEER_LINK_FAILED`, `STRAGGLER`).

pub mod pairing;
pub mod runner;
pub mod verdicts;
