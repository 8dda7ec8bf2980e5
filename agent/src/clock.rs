//! The one clock: every reading of time in the agent and the coordinator goes through an
//! injected [`Clock`] (their `clippy.toml` bans the other readings). [`SystemClock`] reads the
//! real clocks; tests drive `testing::FakeClock`. A leaf module: anything may read time
//! without importing the engine loop.

use std::time::Duration;

use faultline_core::record::BootClock;
use faultline_core::time::Timestamp;

/// Wall-clock time, injectable for tests.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// Wall-clock time: for dates people and other programs read, never for measuring.
    fn now(&self) -> Timestamp;
    /// Time since boot (`CLOCK_BOOTTIME`: monotonic, counts suspend, unmoved by wall-clock
    /// steps): what windows, holds, durations and ages are measured with.
    fn since_boot(&self) -> Duration;
    /// The boot that `since_boot` counts from (the kernel's boot id), if it can be read.
    fn boot_id(&self) -> Option<String>;
    /// Tokio's timer clock: for deadlines handed to tokio's timers (`sleep_until`) and for the
    /// rate limits of [`crate::rate_limit`], never for ages or dates. Every clock shares tokio's:
    /// tests move it by pausing and advancing it (`tokio::time::pause`), the one test clock
    /// for waits.
    #[allow(clippy::disallowed_methods)] // the one reading of tokio's clock
    fn instant(&self) -> tokio::time::Instant {
        tokio::time::Instant::now()
    }
    /// `since_boot` with its boot: a reading that other processes on this node can compare
    /// with theirs, whatever the wall clock did in between.
    fn boot_clock(&self) -> Option<BootClock> {
        Some(BootClock {
            boot_id: self.boot_id()?,
            since_boot_ms: u64::try_from(self.since_boot().as_millis()).unwrap_or(u64::MAX),
        })
    }
    /// Waits until `since_boot` reaches `at`: the engine loop's timer for the engine's next
    /// deadline, on this clock (a test's clock moves only when the test moves it).
    fn sleep_until_boot(&self, at: Duration) -> BoxSleep<'_> {
        Box::pin(async move {
            loop {
                let left = at.saturating_sub(self.since_boot());
                if left.is_zero() {
                    return;
                }
                // Tokio's timers run on CLOCK_MONOTONIC, which stands still during a suspend
                // while this clock runs on: a wake-up after one finds the time left shorter.
                tokio::time::sleep(left).await;
            }
        })
    }
}

/// What [`Clock::sleep_until_boot`] returns.
pub type BoxSleep<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + 'a>>;

/// Where the kernel says which boot this is; a new random id at every boot.
pub const KERNEL_BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

/// The system clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

// The one place that reads the real wall and boot clocks (`clippy.toml` bans the readings
// everywhere else).
#[allow(clippy::disallowed_methods)]
impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        Timestamp::now()
    }
    fn since_boot(&self) -> Duration {
        let t = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
        Duration::new(
            u64::try_from(t.tv_sec).unwrap_or(0),
            u32::try_from(t.tv_nsec).unwrap_or(0),
        )
    }
    /// The kernel's boot id, read once: it cannot change while this process lives. Always the
    /// kernel's own file (not the agent's `--boot-id-path`, a test hook), because the boot
    /// clock read beside it is the kernel's own.
    fn boot_id(&self) -> Option<String> {
        static ID: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
        ID.get_or_init(|| {
            std::fs::read_to_string(KERNEL_BOOT_ID)
                .ok()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
        })
        .clone()
    }
}

/// An injected clock for tests (this crate's, and other crates' through the `test-support`
/// feature).
#[cfg(any(test, feature = "test-support"))]
#[allow(clippy::unwrap_used)] // a test double: a time out of range is a test that already failed
pub mod testing {
    use super::*;
    use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

    /// Wall time, time since boot and the boot id, set by the test.
    #[derive(Debug)]
    pub struct FakeClock {
        wall_ms: AtomicI64,
        boot_ms: AtomicU64,
        boot_id: parking_lot::Mutex<Option<String>>,
        /// Wakes the sleepers of `sleep_until_boot` when the time since boot moves.
        moved: tokio::sync::Notify,
    }

    impl Clock for FakeClock {
        fn now(&self) -> Timestamp {
            Timestamp::from_millisecond(self.wall_ms.load(Ordering::SeqCst)).unwrap()
        }
        fn since_boot(&self) -> Duration {
            Duration::from_millis(self.boot_ms.load(Ordering::SeqCst))
        }
        fn boot_id(&self) -> Option<String> {
            self.boot_id.lock().clone()
        }
        /// Wakes when the test has moved the time since boot to `at`; never on tokio's clock.
        fn sleep_until_boot(&self, at: Duration) -> BoxSleep<'_> {
            Box::pin(async move {
                loop {
                    let moved = self.moved.notified();
                    tokio::pin!(moved);
                    moved.as_mut().enable();
                    if self.since_boot() >= at {
                        return;
                    }
                    moved.await;
                }
            })
        }
    }

    impl FakeClock {
        /// At `wall_ms` (Unix milliseconds), `boot_ms` into boot `boot-1`.
        pub fn new(wall_ms: i64, boot_ms: u64) -> FakeClock {
            FakeClock {
                wall_ms: AtomicI64::new(wall_ms),
                boot_ms: AtomicU64::new(boot_ms),
                boot_id: parking_lot::Mutex::new(Some("boot-1".into())),
                moved: tokio::sync::Notify::new(),
            }
        }
        /// Real time passing: both clocks move.
        pub fn advance(&self, d: Duration) {
            let ms = d.as_millis() as u64;
            self.boot_ms.fetch_add(ms, Ordering::SeqCst);
            self.wall_ms.fetch_add(ms as i64, Ordering::SeqCst);
            self.moved.notify_waiters();
        }
        /// A wall-clock step (NTP, `date -s`): only the wall clock moves.
        pub fn step_wall(&self, secs: i64) {
            self.wall_ms.fetch_add(secs * 1000, Ordering::SeqCst);
        }
        /// A reboot `boot_ms` ago (the wall clock runs on), or a boot id that cannot be read.
        pub fn reboot(&self, boot_id: Option<&str>, boot_ms: u64) {
            *self.boot_id.lock() = boot_id.map(str::to_string);
            self.boot_ms.store(boot_ms, Ordering::SeqCst);
            self.moved.notify_waiters();
        }
    }
}
