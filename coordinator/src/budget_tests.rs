//! Tests of the coordinator's taint budget: the ledger's decisions, and the active replica's
//! admissions against a ledger store that conflicts, fails and is read by a successor.
#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex as StdMutex;

use super::*;
use crate::members::{Member, MembersError};
use faultline_agent::clock::testing::FakeClock;

fn t(s: i64) -> Timestamp {
    Timestamp::from_second(1_790_000_000 + s).unwrap()
}

const WINDOW: Duration = Duration::from_secs(600);

#[test]
fn the_ledger_admits_within_budget_and_window() {
    let mut l = Ledger::default();
    assert_eq!(
        l.decide("a", t(0), WINDOW, 2),
        Admission::Admitted { used: 1 }
    );
    assert_eq!(
        l.decide("a", t(1), WINDOW, 2),
        Admission::AlreadyIn { used: 1 }
    );
    assert_eq!(
        l.decide("b", t(2), WINDOW, 2),
        Admission::Admitted { used: 2 }
    );
    assert_eq!(
        l.decide("c", t(3), WINDOW, 2),
        Admission::Denied { used: 2 }
    );
    // a's entry leaves the window at t(600): c gets in.
    assert_eq!(
        l.decide("c", t(599), WINDOW, 2),
        Admission::Denied { used: 2 }
    );
    assert_eq!(
        l.decide("c", t(600), WINDOW, 2),
        Admission::Admitted { used: 2 }
    );
    let nodes: Vec<&str> = l.entries.iter().map(|e| e.node.as_str()).collect();
    assert_eq!(nodes, ["b", "c"]);
    // A limit of 0 denies everything.
    assert_eq!(
        Ledger::default().decide("a", t(0), WINDOW, 0),
        Admission::Denied { used: 0 }
    );
}

/// The wall clock stepped both ways. Back: an entry dated ahead of now (by however much) counts
/// as made now, so it holds its slot for one window from here: neither freed by the step nor
/// held for ever. Forward past the window: the entry is gone, as the window has passed.
#[test]
fn the_ledger_survives_clock_steps_both_ways() {
    let entry = |at| Ledger {
        entries: vec![LedgerEntry {
            node: "z".into(),
            at,
        }],
    };
    for ahead in [1, 600, 601, 86_400] {
        let mut l = entry(t(ahead));
        assert_eq!(
            l.decide("a", t(0), WINDOW, 1),
            Admission::Denied { used: 1 },
            "an entry {ahead} s ahead"
        );
        assert_eq!(l.entries[0].at, t(0), "clamped to now");
        assert_eq!(
            l.decide("a", t(599), WINDOW, 1),
            Admission::Denied { used: 1 }
        );
        assert_eq!(
            l.decide("a", t(600), WINDOW, 1),
            Admission::Admitted { used: 1 }
        );
    }
    let mut l = entry(t(0));
    assert_eq!(
        l.decide("a", t(3600), WINDOW, 1),
        Admission::Admitted { used: 1 }
    );
}

/// A ledger store in memory, with a version that moves on every write, a write that can be made
/// to conflict (another writer), fail or wait, and a count of writes.
#[derive(Debug, Default)]
struct Memory {
    kept: StdMutex<(Ledger, Option<String>)>,
    writes: AtomicUsize,
    reads: AtomicUsize,
    fail_writes: StdMutex<usize>,
    fail_reads: StdMutex<usize>,
    /// Written by "someone else" before our next write: it conflicts.
    foreign: StdMutex<Option<Ledger>>,
    /// Each write waits for this (a slow API server), when set.
    gate: StdMutex<Option<Arc<tokio::sync::Semaphore>>>,
}

#[async_trait::async_trait]
impl LedgerStore for Memory {
    async fn read(&self) -> Result<(Ledger, Option<String>), StoreError> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        {
            let mut f = self.fail_reads.lock().unwrap();
            if *f > 0 {
                *f -= 1;
                return Err(StoreError::Failed("503 Service Unavailable".into()));
            }
        }
        Ok(self.kept.lock().unwrap().clone())
    }

    async fn write(&self, ledger: &Ledger, version: Option<&str>) -> Result<String, StoreError> {
        let gate = self.gate.lock().unwrap().clone();
        if let Some(g) = gate {
            g.acquire().await.unwrap().forget();
        }
        {
            let mut f = self.fail_writes.lock().unwrap();
            if *f > 0 {
                *f -= 1;
                return Err(StoreError::Failed("500 Internal Server Error".into()));
            }
        }
        let mut kept = self.kept.lock().unwrap();
        if let Some(theirs) = self.foreign.lock().unwrap().take() {
            let v = kept
                .1
                .as_deref()
                .map_or(1, |v| v.parse::<u64>().unwrap() + 1);
            *kept = (theirs, Some(v.to_string()));
        }
        if kept.1.as_deref() != version {
            return Err(StoreError::Conflict);
        }
        self.writes.fetch_add(1, Ordering::SeqCst);
        let v = kept
            .1
            .as_deref()
            .map_or(1, |v| v.parse::<u64>().unwrap() + 1);
        *kept = (ledger.clone(), Some(v.to_string()));
        Ok(v.to_string())
    }
}

/// `n` members, or an error when `fail` is set; counts the lists.
#[derive(Debug)]
struct Fleet {
    n: AtomicUsize,
    fail: std::sync::atomic::AtomicBool,
    lists: AtomicUsize,
}

impl Fleet {
    fn of(n: usize) -> Arc<Fleet> {
        Arc::new(Fleet {
            n: AtomicUsize::new(n),
            fail: false.into(),
            lists: AtomicUsize::new(0),
        })
    }
}

#[async_trait::async_trait]
impl Members for Fleet {
    async fn list(&self) -> Result<Vec<Member>, MembersError> {
        self.lists.fetch_add(1, Ordering::SeqCst);
        if self.fail.load(Ordering::SeqCst) {
            return Err(MembersError::Read {
                path: "pods".into(),
                source: std::io::Error::other("503"),
            });
        }
        Ok((0..self.n.load(Ordering::SeqCst))
            .map(|i| Member {
                node: format!("node-{i:04}"),
                address: format!("10.0.{}.{}:20261", i / 250, i % 250 + 1),
                ip: format!("10.0.{}.{}", i / 250, i % 250 + 1).parse().unwrap(),
                topology: None,
            })
            .collect())
    }
}

fn budget(max_percent: u32) -> TaintBudget {
    TaintBudget {
        max_percent,
        min_nodes: 1,
        window: WINDOW,
    }
}

fn setup(nodes: usize) -> (Arc<TaintLedger>, Arc<Memory>, Arc<Fleet>, Arc<FakeClock>) {
    let store = Arc::new(Memory::default());
    let fleet = Fleet::of(nodes);
    let clock = Arc::new(FakeClock::new(1_790_000_000_000, 1_000_000));
    let l = Arc::new(TaintLedger::new(
        store.clone(),
        fleet.clone(),
        clock.clone(),
    ));
    (l, store, fleet, clock)
}

/// 2,000 nodes, all failing at once: exactly the limit (10 %) is admitted, every admission is
/// in the written ledger before it is answered, and the writes are few (the admissions decided
/// during one write share the next), with one list of the members.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_failing_at_once_admits_exactly_the_limit_with_few_writes() {
    let (l, store, fleet, _) = setup(2000);
    // Each write takes until the test lets it through, so admissions pile up behind it.
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    *store.gate.lock().unwrap() = Some(gate.clone());
    let asks: Vec<_> = (0..2000)
        .map(|i| {
            let (l, store) = (l.clone(), store.clone());
            tokio::spawn(async move {
                let node = format!("node-{i:04}");
                let a = l.admit(&node, &budget(10)).await.unwrap();
                if a.allowed {
                    // Answered only once the ledger holding it was written.
                    let kept = store.kept.lock().unwrap().0.clone();
                    assert!(kept.entries.iter().any(|e| e.node == node), "{node}");
                }
                a
            })
        })
        .collect();
    let releaser = tokio::spawn(async move {
        for _ in 0..200 {
            tokio::time::sleep(Duration::from_millis(5)).await;
            gate.add_permits(1);
        }
    });
    let mut allowed = 0;
    for a in asks {
        let a = a.await.unwrap();
        assert_eq!((a.limit, a.nodes), (200, 2000));
        allowed += usize::from(a.allowed);
    }
    releaser.abort();
    assert_eq!(allowed, 200);
    assert_eq!(store.kept.lock().unwrap().0.entries.len(), 200);
    let writes = store.writes.load(Ordering::SeqCst);
    assert!(writes < 200, "{writes} writes for 200 admissions");
    assert_eq!(fleet.lists.load(Ordering::SeqCst), 1);
}

/// A replica that takes over reads the ledger first: the previous replica's admissions still
/// count, in the same window.
#[tokio::test]
async fn a_successor_keeps_the_window() {
    let (first, store, fleet, clock) = setup(10);
    assert!(first.admit("node-0001", &budget(10)).await.unwrap().allowed);
    let second = TaintLedger::new(store.clone(), fleet, clock.clone());
    let denied = second.admit("node-0002", &budget(10)).await.unwrap();
    assert_eq!(
        denied,
        Answer {
            allowed: false,
            used: 1,
            limit: 1,
            nodes: 10
        }
    );
    // The window moves on: room again.
    clock.advance(WINDOW);
    assert!(
        second
            .admit("node-0002", &budget(10))
            .await
            .unwrap()
            .allowed
    );
}

/// Another writer got in between (a replica that still thought it held the Lease, or a
/// person): its ledger is taken as it is, the admission this write carried fails (the agent asks
/// again), and the next decision is made against the ledger as it now stands, so the limit
/// holds across both writers. A write whose ConfigMap was deleted meanwhile starts afresh.
#[tokio::test]
async fn a_conflicting_writer_never_lets_more_than_the_limit_in() {
    let (l, store, _, _) = setup(20);
    // Limit 2 of 20.
    assert!(l.admit("node-0001", &budget(10)).await.unwrap().allowed);
    *store.foreign.lock().unwrap() = Some(Ledger {
        entries: vec![
            LedgerEntry {
                node: "node-0001".into(),
                at: t(0),
            },
            LedgerEntry {
                node: "node-0009".into(),
                at: t(0),
            },
        ],
    });
    // node-0002 is decided in memory (2 of 2), its write conflicts: not allowed, ask again.
    let e = l.admit("node-0002", &budget(10)).await.unwrap_err();
    assert!(matches!(e, BudgetError::Write(_)), "{e}");
    let kept: Vec<String> = store
        .kept
        .lock()
        .unwrap()
        .0
        .entries
        .iter()
        .map(|e| e.node.clone())
        .collect();
    assert_eq!(
        kept,
        ["node-0001", "node-0009"],
        "the other writer's ledger stands"
    );
    // Asked again: the two slots are the other writer's decisions.
    let again = l.admit("node-0002", &budget(10)).await.unwrap();
    assert_eq!((again.allowed, again.used, again.limit), (false, 2, 2));
    assert!(
        l.admit("node-0009", &budget(10)).await.unwrap().allowed,
        "already in"
    );
}

/// A ledger that cannot be read or written answers nothing (the agent withholds the taint and
/// asks again); an admission whose write failed is answered by the next write that succeeds.
#[tokio::test]
async fn a_ledger_that_cannot_be_written_admits_nobody_until_it_can() {
    let (l, store, _, _) = setup(10);
    *store.fail_reads.lock().unwrap() = 1;
    let e = l.admit("node-0001", &budget(10)).await.unwrap_err();
    assert!(matches!(e, BudgetError::Read(_)), "{e}");
    *store.fail_writes.lock().unwrap() = 1;
    let e = l.admit("node-0001", &budget(10)).await.unwrap_err();
    assert!(matches!(e, BudgetError::Write(_)), "{e}");
    assert!(store.kept.lock().unwrap().0.entries.is_empty());
    // Asked again: written now, allowed.
    assert!(l.admit("node-0001", &budget(10)).await.unwrap().allowed);
    assert_eq!(store.kept.lock().unwrap().0.entries.len(), 1);
    // The slot is the node's: another node is denied.
    assert!(!l.admit("node-0002", &budget(10)).await.unwrap().allowed);
}

/// The node count is taken at most once a minute; while the members cannot be listed an older
/// count serves for ten minutes, then the budget cannot answer.
#[tokio::test]
async fn the_node_count_is_reused_and_then_refused_when_stale() {
    let (l, _, fleet, clock) = setup(30);
    let b = budget(10);
    assert_eq!(l.admit("node-0001", &b).await.unwrap().nodes, 30);
    fleet.n.store(50, Ordering::SeqCst);
    clock.advance(Duration::from_secs(59));
    assert_eq!(l.admit("node-0001", &b).await.unwrap().nodes, 30);
    clock.advance(Duration::from_secs(1));
    assert_eq!(l.admit("node-0001", &b).await.unwrap().nodes, 50);
    fleet.fail.store(true, Ordering::SeqCst);
    clock.advance(Duration::from_secs(540));
    assert_eq!(l.admit("node-0001", &b).await.unwrap().nodes, 50);
    clock.advance(Duration::from_secs(61));
    let e = l.admit("node-0001", &b).await.unwrap_err();
    assert!(matches!(e, BudgetError::Count(_)), "{e}");
}

/// A replica that lost the Lease forgets the ledger and reads it again when it is active again,
/// so the admissions the other replica made meanwhile count.
#[tokio::test]
async fn losing_the_lease_forgets_the_ledger() {
    let (l, store, fleet, clock) = setup(10);
    let (leader, rx) = watch::channel(true);
    let follow = tokio::spawn(l.clone().follow(rx));
    assert!(l.admit("node-0001", &budget(20)).await.unwrap().allowed);
    leader.send(false).unwrap();
    // The other replica admits node-0002 meanwhile.
    let other = TaintLedger::new(store.clone(), fleet, clock);
    assert!(other.admit("node-0002", &budget(20)).await.unwrap().allowed);
    tokio::time::timeout(Duration::from_secs(5), async {
        while l.state.lock().await.loaded {
            tokio::task::yield_now().await;
        }
    })
    .await
    .unwrap();
    leader.send(true).unwrap();
    let reads = store.reads.load(Ordering::SeqCst);
    assert!(!l.admit("node-0003", &budget(20)).await.unwrap().allowed);
    assert_eq!(store.reads.load(Ordering::SeqCst), reads + 1);
    follow.abort();
}

/// The ledger's document: what a person reading the ConfigMap sees; a field it does not know
/// costs no entry.
#[test]
fn the_ledger_document() {
    let l = Ledger {
        entries: vec![LedgerEntry {
            node: "a".into(),
            at: t(0),
        }],
    };
    let text = serde_json::to_string(&l).unwrap();
    assert_eq!(
        text,
        r#"{"entries":[{"node":"a","at":"2026-09-21T14:13:20.000Z"}]}"#
    );
    let with_more: Ledger = serde_json::from_str(
        r#"{"entries":[{"node":"a","at":"2026-09-21T14:13:20.000Z"}],"nodes":{"count":3}}"#,
    )
    .unwrap();
    assert_eq!(with_more, l);
}

/// The budget off (`max_percent: 100`): every node is allowed and the ledger is not written, so
/// a fleet-wide incident costs no writes and the ledger cannot outgrow its ConfigMap.
#[tokio::test]
async fn with_the_budget_off_nothing_is_written() {
    let (l, store, _, _) = setup(3);
    for n in ["node-0000", "node-0001", "node-0002"] {
        assert!(l.admit(n, &budget(100)).await.unwrap().allowed);
    }
    assert_eq!(store.writes.load(Ordering::SeqCst), 0);
}

/// Members that cannot be listed in time (the API client retrying a 503 by itself): the last
/// count serves, instead of every admission waiting for the list.
#[tokio::test(start_paused = true)]
async fn a_members_list_that_hangs_falls_back_to_the_last_count() {
    #[derive(Debug)]
    struct Hangs(AtomicUsize);
    #[async_trait::async_trait]
    impl Members for Hangs {
        async fn list(&self) -> Result<Vec<Member>, MembersError> {
            if self.0.fetch_add(1, Ordering::SeqCst) == 0 {
                return Fleet::of(40).list().await;
            }
            std::future::pending().await
        }
    }
    let clock = Arc::new(FakeClock::new(1_790_000_000_000, 1_000_000));
    let l = TaintLedger::new(
        Arc::new(Memory::default()),
        Arc::new(Hangs(AtomicUsize::new(0))),
        clock.clone(),
    );
    assert_eq!(l.admit("node-0001", &budget(10)).await.unwrap().nodes, 40);
    clock.advance(Duration::from_secs(120));
    let a = l.admit("node-0002", &budget(10)).await.unwrap();
    assert_eq!((a.allowed, a.nodes), (true, 40));
}

/// The Lease lost while an admission's write is in flight, and regained before it lands: the
/// admission is not answered "allowed" (its agent asks again), and an admission of the new term
/// is never answered on the strength of the old term's write: the budget of one holds.
#[tokio::test]
async fn an_admission_whose_replica_lost_the_lease_mid_write_is_asked_again() {
    let (l, store, _, _) = setup(10);
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    *store.gate.lock().unwrap() = Some(gate.clone());
    let (leader, rx) = watch::channel(true);
    let follow = tokio::spawn(l.clone().follow(rx));
    let asking = tokio::spawn({
        let l = l.clone();
        async move { l.admit("node-0001", &budget(10)).await }
    });
    // The admission is decided and its write waits at the store.
    tokio::time::timeout(Duration::from_secs(5), async {
        while l.state.lock().await.decided == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .unwrap();
    leader.send(false).unwrap();
    tokio::time::timeout(Duration::from_secs(5), async {
        while l.state.lock().await.loaded {
            tokio::task::yield_now().await;
        }
    })
    .await
    .unwrap();
    // Active again before that write lands: node-0002 is decided against the ledger read now
    // (without node-0001) and waits behind the write in flight.
    leader.send(true).unwrap();
    let second = tokio::spawn({
        let l = l.clone();
        async move { l.admit("node-0002", &budget(10)).await }
    });
    tokio::time::timeout(Duration::from_secs(5), async {
        while l.state.lock().await.decided == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .unwrap();
    gate.add_permits(8);
    let e = asking.await.unwrap().unwrap_err();
    assert!(matches!(e, BudgetError::Write(_)), "{e}");
    // node-0002 is never answered without a write that holds it: its write finds the ledger
    // changed (node-0001's landed) and it is asked again.
    let r = second.await.unwrap();
    if let Ok(a) = &r {
        assert!(a.allowed);
        let kept = store.kept.lock().unwrap().0.clone();
        assert!(
            kept.entries.iter().any(|e| e.node == "node-0002"),
            "{kept:?}"
        );
    }
    // Asked again: node-0001's landed write holds the one slot (10 % of 10).
    let again = l.admit("node-0002", &budget(10)).await.unwrap();
    assert!(!again.allowed, "{again:?}");
    follow.abort();
}
