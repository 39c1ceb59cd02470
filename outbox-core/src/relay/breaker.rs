//! The circuit breaker (R62): after `failure_threshold` failed publishes in a row the relay
//! stops fetching for `recovery_timeout`.

use std::time::Duration;

use crate::error::ConfigError;
use crate::event::limits;

use super::Relay;

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

#[derive(Debug, Default)]
pub(super) struct BreakerState {
    failures: u32,
    opened_at: Option<tokio::time::Instant>,
}

impl Relay {
    pub(super) fn breaker_allows_fetch(&self) -> bool {
        let Some(cfg) = self.config.breaker else {
            return true;
        };
        let st = self.breaker.lock().expect("breaker poisoned");
        match st.opened_at {
            None => true,
            Some(at) => self.clock.now().saturating_duration_since(at) >= cfg.recovery_timeout,
        }
    }

    /// Records a publish result in the breaker; true when it (re)opened.
    pub(super) fn breaker_record(&self, success: bool) -> bool {
        let Some(cfg) = self.config.breaker else {
            return false;
        };
        let mut st = self.breaker.lock().expect("breaker poisoned");
        if success {
            st.failures = 0;
            st.opened_at = None;
            false
        } else {
            st.failures = st.failures.saturating_add(1);
            if st.failures >= cfg.failure_threshold {
                st.opened_at = Some(self.clock.now());
                true
            } else {
                false
            }
        }
    }

    pub(super) fn breaker_is_open(&self) -> bool {
        self.config.breaker.is_some()
            && self
                .breaker
                .lock()
                .expect("breaker poisoned")
                .opened_at
                .is_some()
    }
}
