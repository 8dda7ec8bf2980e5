//! What an operator's clear request did: the engine loop's report on it ([`ClearApplied`]), the
//! answer the CLI reads ([`ClearResult`]), and the requests remembered so that one read twice is
//! applied once ([`AppliedClears`]). A leaf module: the clear requests' source
//! (`source::control`), the engine loop and the CLI all use it.

use std::collections::VecDeque;

use faultline_core::engine::EngineEvent;
use serde::{Deserialize, Serialize};

/// Most cleared faults an answer names (its count is always the whole number).
pub(crate) const MAX_LISTED: usize = 20;
/// The largest answer the CLI reads: [`MAX_LISTED`] faults of two fields of at most a few KiB.
pub(crate) const MAX_RESULT_BYTES: u64 = 256 << 10;
/// How many applied requests the saved state remembers (a restart finds at most the few requests
/// that were in flight).
pub(crate) const REMEMBERED_CLEARS: usize = 16;

/// One fault a clear ended, as `faultline get` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClearedFault {
    pub code: String,
    pub device: String,
}

/// What a request did: the answer the agent writes to `<name>.json.done` once the clear is on
/// disk.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClearResult {
    /// How many active faults it ended (0: none matched).
    pub cleared: u64,
    /// The first [`MAX_LISTED`] of them.
    pub faults: Vec<ClearedFault>,
}

impl ClearResult {
    /// The faults the engine step of a clear ended: its `Recovered` events.
    pub(crate) fn of(events: &[EngineEvent]) -> ClearResult {
        let mut r = ClearResult::default();
        for e in events {
            if let EngineEvent::Recovered { code, device, .. } = e {
                r.cleared += 1;
                if r.faults.len() < MAX_LISTED {
                    r.faults.push(ClearedFault {
                        code: code.clone(),
                        device: device.clone(),
                    });
                }
            }
        }
        r
    }
}

/// The engine loop's report on one clear request (`Input::Clear`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClearApplied {
    pub marker: u64,
    pub result: ClearResult,
}

/// The requests the engine loop applied lately, by identity (`source::control`'s request key), with what each
/// did; oldest first, at most [`REMEMBERED_CLEARS`]. Saved with the engine state.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppliedClears(VecDeque<(String, ClearResult)>);

impl AppliedClears {
    /// What request `key` did, if it was applied.
    pub fn get(&self, key: &str) -> Option<&ClearResult> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, r)| r)
    }

    /// Remembers that request `key` was applied, forgetting the oldest beyond the bound.
    pub(crate) fn insert(&mut self, key: String, result: ClearResult) {
        self.0.push_back((key, result));
        while self.0.len() > REMEMBERED_CLEARS {
            self.0.pop_front();
        }
    }
}

/// The answer to a clear that ended `n` faults, `Xid79` on `GPU-0`... (tests).
#[cfg(test)]
pub(crate) fn answer(n: u64) -> ClearResult {
    ClearResult {
        cleared: n,
        faults: (0..n)
            .map(|i| ClearedFault {
                code: "Xid79".into(),
                device: format!("GPU-{i}"),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The saved memory of applied requests is bounded: the oldest goes first.
    #[test]
    fn applied_clears_keep_the_newest() {
        let mut a = AppliedClears::default();
        for i in 0..=REMEMBERED_CLEARS as u64 {
            a.insert(format!("{i}.json"), answer(i));
        }
        assert_eq!(a.get("0.json"), None, "forgotten");
        assert_eq!(a.get("1.json"), Some(&answer(1)));
        let last = format!("{REMEMBERED_CLEARS}.json");
        assert_eq!(a.get(&last), Some(&answer(REMEMBERED_CLEARS as u64)));
        assert_eq!(a.0.len(), REMEMBERED_CLEARS);
    }
}
