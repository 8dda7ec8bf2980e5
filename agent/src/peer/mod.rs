//! Peer-paired collective checks: agents check each other in pairs and the coordinator locates
//! faulty nodes, broken links and stragglers from the results. `pairing` is the pure core (the
//! planner and its verdicts, plus a simulator for tests and benchmarks).

pub mod pairing;
