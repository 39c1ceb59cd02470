//! Time as an input.
//!
//! Two clocks drive the contract:
//!
//! * the **backend clock** ([`Clock`]): wall time that decides due-ness, leases, created_at and
//!   retry times (contract R72). Postgres backends use the database clock; the in-memory backend
//!   takes a [`Clock`], usually a [`ManualClock`] in tests so they advance time instead of
//!   sleeping;
//! * the **relay clock** ([`RelayClock`]): a monotonic clock for the lease margin (R49) and the
//!   circuit breaker (R62).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};

/// A source of wall-clock time (UTC).
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// The current instant.
    fn now(&self) -> DateTime<Utc>;
}

/// The system clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// A clock that only moves when told to. Cloning shares the same time.
#[derive(Debug, Clone)]
pub struct ManualClock {
    now: Arc<Mutex<DateTime<Utc>>>,
}

impl ManualClock {
    /// A clock standing at `start`.
    pub fn new(start: DateTime<Utc>) -> Self {
        Self {
            now: Arc::new(Mutex::new(start)),
        }
    }

    /// A clock standing at the current system time.
    pub fn starting_now() -> Self {
        Self::new(Utc::now())
    }

    /// Moves the clock forward by `d`, saturating at the latest time chrono represents.
    pub fn advance(&self, d: Duration) {
        let mut now = self.now.lock().expect("clock poisoned");
        *now = chrono::Duration::from_std(d)
            .ok()
            .and_then(|d| now.checked_add_signed(d))
            .unwrap_or(DateTime::<Utc>::MAX_UTC);
    }

    /// Sets the clock to `t`.
    pub fn set(&self, t: DateTime<Utc>) {
        *self.now.lock().expect("clock poisoned") = t;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        *self.now.lock().expect("clock poisoned")
    }
}

/// The relay's monotonic clock (lease margin R49, circuit breaker R62).
///
/// The default reads [`tokio::time::Instant`], so a paused tokio runtime controls it; a
/// [`ManualRelayClock`] adds an offset that a test moves.
pub trait RelayClock: Send + Sync + std::fmt::Debug {
    /// The current monotonic instant.
    fn now(&self) -> tokio::time::Instant;
}

/// [`RelayClock`] reading tokio's clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct TokioClock;

impl RelayClock for TokioClock {
    fn now(&self) -> tokio::time::Instant {
        tokio::time::Instant::now()
    }
}

/// A relay clock that runs with tokio's clock plus an offset moved by [`advance`](Self::advance).
#[derive(Debug, Clone, Default)]
pub struct ManualRelayClock {
    offset: Arc<Mutex<Duration>>,
}

impl ManualRelayClock {
    /// A clock with no offset.
    pub fn new() -> Self {
        Self::default()
    }

    /// Moves the clock forward by `d` (saturating).
    pub fn advance(&self, d: Duration) {
        let mut offset = self.offset.lock().expect("clock poisoned");
        *offset = offset.saturating_add(d);
    }
}

impl RelayClock for ManualRelayClock {
    fn now(&self) -> tokio::time::Instant {
        let now = tokio::time::Instant::now();
        // An offset past the Instant's range stays far ahead instead of overflowing.
        let offset = *self.offset.lock().expect("clock poisoned");
        now.checked_add(offset)
            .or_else(|| now.checked_add(Duration::from_secs(u64::from(u32::MAX))))
            .unwrap_or(now)
    }
}
