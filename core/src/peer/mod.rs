//! The pure half of the peer checks: the pairing planner (rounds, partners, evidence rules,
//! a simulator) and the turning of a run's verdicts into this node's observations. The
//! coordinator, the gRPC service and the probe runner that drive them live in the agent.

pub mod pairing;
pub mod verdicts;
