//! The circuit breaker (R62), the one the relay, the inbox runner and the inbox processor share:
//! after `failure_threshold` failures in a row it opens, and the work it guards (the relay's
//! fetches, the runner's reads and runs, the processor's fetches and runs) waits until
//! `recovery_timeout` passed since it (re)opened. Then it half-opens: work goes ahead, and the
//! next failure reopens it at once (the count is still at or past the threshold) while a
//! success closes it and clears the count.
//!
//! What counts as a failure or a success is the owner's: the relay counts publishes (R62), the
//! runner and the processor count handler runs (R120, R158). Time is an input: every call takes
//! the owner's monotonic now, so tests advance a clock instead of sleeping.

use std::time::Duration;

use tokio::time::Instant;

use crate::error::ConfigError;
use crate::event::limits;

/// Circuit breaker settings (R62).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BreakerConfig {
    failure_threshold: u32,
    recovery_timeout: Duration,
}

impl BreakerConfig {
    /// Threshold ≥ 1 (default 5), recovery 0 s to 365 days (default 60 s).
    pub fn new(failure_threshold: i64, recovery_timeout_seconds: f64) -> Result<Self, ConfigError> {
        if failure_threshold < 1 || failure_threshold > u32::MAX as i64 {
            return Err(ConfigError::new(format!(
                "failure_threshold must be >= 1, got {failure_threshold}"
            )));
        }
        if !recovery_timeout_seconds.is_finite() || recovery_timeout_seconds < 0.0 {
            return Err(ConfigError::new(format!(
                "recovery_timeout must be >= 0, got {recovery_timeout_seconds}"
            )));
        }
        if recovery_timeout_seconds > limits::SETTING_MAX_SECS as f64 {
            return Err(ConfigError::new(format!(
                "recovery_timeout must be at most {} s (365 days), got {recovery_timeout_seconds}",
                limits::SETTING_MAX_SECS
            )));
        }
        Ok(Self {
            failure_threshold: failure_threshold as u32,
            recovery_timeout: Duration::from_secs_f64(recovery_timeout_seconds),
        })
    }
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            failure_threshold: 5,
            recovery_timeout: Duration::from_secs(60),
        }
    }
}

/// One circuit breaker: its settings, the failures in a row, and when it last (re)opened.
#[derive(Debug, Clone)]
pub(crate) struct Breaker {
    config: BreakerConfig,
    failures: u32,
    opened_at: Option<Instant>,
}

impl Breaker {
    /// A closed breaker.
    pub(crate) fn new(config: BreakerConfig) -> Self {
        Self {
            config,
            failures: 0,
            opened_at: None,
        }
    }

    /// Whether the guarded work may go ahead at `now`: closed, or open for at least the
    /// recovery timeout (half-open).
    pub(crate) fn allows(&self, now: Instant) -> bool {
        self.reopens_at().is_none_or(|at| now >= at)
    }

    /// When an open breaker lets work go ahead again; `None` while closed.
    pub(crate) fn reopens_at(&self) -> Option<Instant> {
        self.opened_at
            .map(|at| at.checked_add(self.config.recovery_timeout).unwrap_or(at))
    }

    /// Whether it is open (or half-open): a failure opened it and no success closed it since.
    pub(crate) fn is_open(&self) -> bool {
        self.opened_at.is_some()
    }

    /// A success: closed, the count cleared.
    pub(crate) fn success(&mut self) {
        self.failures = 0;
        self.opened_at = None;
    }

    /// A failure at `now`; true when it (re)opened the breaker.
    pub(crate) fn failure(&mut self, now: Instant) -> bool {
        self.failures = self.failures.saturating_add(1);
        if self.failures >= self.config.failure_threshold {
            self.opened_at = Some(now);
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{ManualRelayClock, RelayClock};

    fn breaker(threshold: i64, recovery: f64) -> Breaker {
        Breaker::new(BreakerConfig::new(threshold, recovery).expect("config"))
    }

    #[test]
    fn opens_after_the_threshold_and_half_opens_after_the_recovery_timeout() {
        let clock = ManualRelayClock::new();
        let mut b = breaker(3, 10.0);
        assert!(!b.failure(clock.now()));
        assert!(!b.failure(clock.now()));
        assert!(b.allows(clock.now()) && !b.is_open());
        assert!(b.failure(clock.now()), "the third failure opens it");
        assert!(b.is_open());
        assert!(!b.allows(clock.now()));
        clock.advance(Duration::from_millis(9_999));
        assert!(
            !b.allows(clock.now()),
            "still open 1 ms before the recovery timeout"
        );
        clock.advance(Duration::from_millis(1));
        assert!(b.allows(clock.now()), "half-open at the recovery timeout");
        assert!(b.is_open(), "half-open is still open until a success");
    }

    #[test]
    fn a_failure_while_half_open_reopens_it_for_a_full_recovery_timeout() {
        let clock = ManualRelayClock::new();
        let mut b = breaker(2, 5.0);
        b.failure(clock.now());
        assert!(b.failure(clock.now()));
        clock.advance(Duration::from_secs(5));
        assert!(b.allows(clock.now()));
        let reopened = clock.now();
        assert!(
            b.failure(reopened),
            "one failure reopens a half-open breaker"
        );
        assert_eq!(b.reopens_at(), Some(reopened + Duration::from_secs(5)));
        clock.advance(Duration::from_secs(4));
        assert!(!b.allows(clock.now()));
        clock.advance(Duration::from_secs(1));
        assert!(b.allows(clock.now()));
    }

    #[test]
    fn a_success_closes_it_and_clears_the_count() {
        let clock = ManualRelayClock::new();
        let mut b = breaker(2, 60.0);
        b.failure(clock.now());
        b.success();
        assert!(
            !b.failure(clock.now()),
            "the count started again after the success"
        );
        assert!(b.failure(clock.now()));
        assert!(!b.allows(clock.now()));
        b.success();
        assert!(b.allows(clock.now()) && !b.is_open() && b.reopens_at().is_none());
    }

    #[test]
    fn a_zero_recovery_timeout_never_holds_work_back() {
        let clock = ManualRelayClock::new();
        let mut b = breaker(1, 0.0);
        assert!(b.failure(clock.now()));
        assert!(b.is_open() && b.allows(clock.now()));
    }
}
