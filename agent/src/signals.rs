//! What each signal does to the agent (docs/operations.md, "Shutdown and restarts"). Every
//! signal whose default action ends the process and that a handler can catch is handled: a
//! graceful stop that flushes the record and the state, a policy reload, or a line in the log
//! and nothing else. None ends the agent without its flush.
//!
//! Not handled, on purpose: SIGKILL and SIGSTOP (no process can catch them), and the signals the
//! kernel raises for a fault in the agent's own code (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP,
//! SIGSYS, and SIGABRT from `abort`): returning from a handler re-runs the faulting
//! instruction, and a flush from a broken process could write a wrong record. They end it as
//! SIGKILL would; the files keep the last state written, and the next start reads the kernel
//! log again from the saved cursor.

use std::io;

use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;

/// What the agent does on a signal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Stop: apply what was read, flush the record and the state, exit with this status.
    Stop { exit: u8 },
    /// Re-read the policy file now.
    Reload,
    /// Log it and go on.
    Ignore,
}

/// One handled signal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handled {
    pub name: String,
    pub number: i32,
    pub action: Action,
}

/// glibc's `SIGRTMIN()`: it keeps the kernel's first two real-time signals (32 and 33) for its
/// own threads (glibc `sysdeps/unix/sysv/linux/internal-signals.h`: `SIGCANCEL` is
/// `__SIGRTMIN`, `SIGSETXID` is `__SIGRTMIN + 1`; `allocrtsig.c`, `__libc_current_sigrtmin`);
/// musl keeps three (`src/internal/pthread_impl.h`: `SIGTIMER`, `SIGCANCEL`, `SIGSYNCCALL`).
/// A handler installed on those would break the C library's threads.
#[cfg(not(target_env = "musl"))]
pub(crate) const RT_MIN: i32 = 34;
#[cfg(target_env = "musl")]
pub(crate) const RT_MIN: i32 = 35;
/// The kernel's last signal (`_NSIG`, include/uapi/asm-generic/signal.h).
pub(crate) const RT_MAX: i32 = 64;

/// Every handled signal and what it does.
///
/// - SIGTERM, SIGINT (what Kubernetes, systemd and a terminal send) and SIGPWR (a power failure;
///   LXC sends it to ask a container to shut down): stop, exit 0.
/// - SIGXCPU (the soft CPU-time limit reached; the kernel kills at the hard limit): stop while
///   there is time, exit 152 (128 + 24, as a shell reports that signal): a failure.
/// - SIGHUP: reload the policy.
/// - Ignored, with a log line: signals that mean nothing to the agent and that no one sends to
///   stop a daemon: SIGUSR1, SIGUSR2, SIGQUIT (asked for a core dump: there is nothing to dump),
///   the timer signals SIGALRM, SIGVTALRM, SIGPROF (the agent sets no such timer), SIGIO (it
///   asks for no such notice), SIGSTKFLT (unused on Linux), the real-time signals, and
///   SIGXFSZ: the kernel sends it when a write passes the file-size limit, and the write then
///   fails with EFBIG, which the writer already handles (retried, the `record-file` detector
///   down, the record kept where it fits); stopping would only flush into the same limit.
/// - SIGPIPE is not here: the Rust runtime ignores it before `main`, so a closed socket is an
///   error of the write that met it.
pub fn table() -> Vec<Handled> {
    use rustix::process::Signal as S;
    let stop = Action::Stop { exit: 0 };
    [
        ("SIGTERM", S::TERM, stop),
        ("SIGINT", S::INT, stop),
        ("SIGPWR", S::POWER, stop),
        ("SIGXCPU", S::XCPU, Action::Stop { exit: 128 + 24 }),
        ("SIGHUP", S::HUP, Action::Reload),
        ("SIGUSR1", S::USR1, Action::Ignore),
        ("SIGUSR2", S::USR2, Action::Ignore),
        ("SIGQUIT", S::QUIT, Action::Ignore),
        ("SIGALRM", S::ALARM, Action::Ignore),
        ("SIGVTALRM", S::VTALARM, Action::Ignore),
        ("SIGPROF", S::PROF, Action::Ignore),
        ("SIGIO", S::IO, Action::Ignore),
        ("SIGSTKFLT", S::STKFLT, Action::Ignore),
        ("SIGXFSZ", S::XFSZ, Action::Ignore),
    ]
    .into_iter()
    .map(|(name, s, action)| Handled {
        name: name.to_string(),
        number: s.as_raw(),
        action,
    })
    .chain((RT_MIN..=RT_MAX).map(|n| Handled {
        name: format!("SIGRTMIN+{}", n - RT_MIN),
        number: n,
        action: Action::Ignore,
    }))
    .collect()
}

/// Installs a handler for every signal of [`table`]; each signal received comes out of the
/// returned channel. Call it before anything starts, so that a signal during start-up is
/// handled too.
pub fn install() -> io::Result<mpsc::UnboundedReceiver<Handled>> {
    let (tx, rx) = mpsc::unbounded_channel();
    for h in table() {
        let mut s = signal(SignalKind::from_raw(h.number))?;
        let tx = tx.clone();
        tokio::spawn(async move {
            while s.recv().await.is_some() {
                if tx.send(h.clone()).is_err() {
                    break;
                }
            }
        });
    }
    Ok(rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every signal that ends a process by default and can be caught (signal(7): the "Term" and
    /// "Core" signals, less the kernel's own fault signals and SIGPIPE, which Rust ignores) is
    /// in the table, once; SIGTERM stops with a flush and exit 0.
    #[test]
    fn every_catchable_fatal_signal_is_handled_once() {
        use rustix::process::Signal as S;
        let t = table();
        let mut numbers: Vec<i32> = t.iter().map(|h| h.number).collect();
        numbers.sort_unstable();
        numbers.dedup();
        assert_eq!(numbers.len(), t.len(), "each signal once");
        for s in [
            S::HUP,
            S::INT,
            S::QUIT,
            S::ALARM,
            S::TERM,
            S::USR1,
            S::USR2,
            S::POWER,
            S::XCPU,
            S::XFSZ,
            S::VTALARM,
            S::PROF,
            S::IO,
            S::STKFLT,
        ] {
            assert!(numbers.contains(&s.as_raw()), "{s:?}");
        }
        for n in RT_MIN..=RT_MAX {
            assert!(numbers.contains(&n), "real-time {n}");
        }
        for s in [S::SEGV, S::BUS, S::FPE, S::ILL, S::KILL, S::STOP, S::PIPE] {
            assert!(!numbers.contains(&s.as_raw()), "{s:?} is not handled");
        }
        assert!(
            !numbers.contains(&32) && !numbers.contains(&33),
            "the C library's own"
        );
        let term = t.iter().find(|h| h.name == "SIGTERM").unwrap();
        assert_eq!(term.action, Action::Stop { exit: 0 });
    }
}
