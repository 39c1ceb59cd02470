//! Retry backoff for counted failures (contract R38 to R42), as a pure function.
//!
//! With `a` = attempts_made before the failure, the window ceiling is
//! `delay = min(cap, base × 2^a)` and the retry comes after a draw from the jitter mode's range:
//!
//! | mode | range |
//! |---|---|
//! | [`Jitter::Equal`] (the relay's, R39) | `[delay/2, delay]` |
//! | [`Jitter::Full`] | `[0, delay]` |
//! | [`Jitter::Decorrelated`] | `[base, min(cap, 3 × previous ceiling)]`, previous ceiling = `min(cap, base × 2^(a−1))` (`base` for a = 0) |
//!
//! The random draw comes from a [`RandomSource`] giving a unit value in `[0, 1]`, so tests fix
//! it ([`Fixed`]) or seed it ([`SeededRng`]). Base 0 turns backoff off ([`Backoff::delay`]
//! returns `None`: keep the schedule, retry next cycle). Large `a` saturates at the cap without
//! overflow. Checked by conformance scenarios B-01 to B-05, B-10, H-10 to H-12.

use std::time::Duration;

use rand::{RngExt, SeedableRng};

use crate::error::ConfigError;
use crate::event::limits::SETTING_MAX_SECS;

/// Default backoff base in seconds (R39).
pub const DEFAULT_BASE_SECONDS: f64 = 10.0;
/// Default backoff cap in seconds (R39).
pub const DEFAULT_CAP_SECONDS: f64 = 3600.0;
/// Delay of a transient failure, whatever the backoff settings (R43).
pub const TRANSIENT_RETRY: Duration = Duration::from_secs(1);

/// How a delay is drawn inside its window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Jitter {
    /// Uniform in `[delay/2, delay]` (the contract's choice: never close to 0).
    #[default]
    Equal,
    /// Uniform in `[0, delay]`.
    Full,
    /// Uniform in `[base, min(cap, 3 × previous ceiling)]`.
    Decorrelated,
}

/// A source of unit random values in `[0, 1]`.
pub trait RandomSource: Send {
    /// The next value in `[0, 1]`.
    fn unit(&mut self) -> f64;
}

/// A source that always returns the same value (clamped to `[0, 1]`).
#[derive(Debug, Clone, Copy)]
pub struct Fixed(pub f64);

impl RandomSource for Fixed {
    fn unit(&mut self) -> f64 {
        self.0.clamp(0.0, 1.0)
    }
}

/// A seeded standard RNG.
#[derive(Debug)]
pub struct SeededRng(rand::rngs::StdRng);

impl SeededRng {
    /// An RNG from a seed.
    pub fn new(seed: u64) -> Self {
        Self(rand::rngs::StdRng::seed_from_u64(seed))
    }

    /// An RNG seeded from the operating system.
    pub fn from_entropy() -> Self {
        Self::new(rand::random())
    }
}

impl RandomSource for SeededRng {
    fn unit(&mut self) -> f64 {
        self.0.random::<f64>()
    }
}

/// Backoff settings: base and cap in seconds, validated (R40).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    base: f64,
    cap: f64,
    jitter: Jitter,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            base: DEFAULT_BASE_SECONDS,
            cap: DEFAULT_CAP_SECONDS,
            jitter: Jitter::Equal,
        }
    }
}

impl Backoff {
    /// Validated settings with equal jitter. base < 0 and cap ≤ 0 are errors with the
    /// ancestor's texts; a cap above 365 days ([`SETTING_MAX_SECS`]) is an error too, so every
    /// delay fits any clock.
    pub fn new(base_seconds: f64, cap_seconds: f64) -> Result<Self, ConfigError> {
        if !base_seconds.is_finite() || base_seconds < 0.0 {
            return Err(ConfigError::new(format!(
                "retry_backoff_base_seconds must be >= 0, got {base_seconds}"
            )));
        }
        if !cap_seconds.is_finite() || cap_seconds <= 0.0 {
            return Err(ConfigError::new(format!(
                "retry_backoff_cap_seconds must be > 0, got {cap_seconds}"
            )));
        }
        if cap_seconds > SETTING_MAX_SECS as f64 {
            return Err(ConfigError::new(format!(
                "retry_backoff_cap_seconds must be at most {SETTING_MAX_SECS} (365 days), got {cap_seconds}"
            )));
        }
        Ok(Self {
            base: base_seconds,
            cap: cap_seconds,
            jitter: Jitter::Equal,
        })
    }

    /// The same settings with another jitter mode.
    pub fn with_jitter(mut self, jitter: Jitter) -> Self {
        self.jitter = jitter;
        self
    }

    /// Base in seconds.
    pub fn base_seconds(&self) -> f64 {
        self.base
    }

    /// Cap in seconds.
    pub fn cap_seconds(&self) -> f64 {
        self.cap
    }

    /// The jitter mode.
    pub fn jitter(&self) -> Jitter {
        self.jitter
    }

    /// The window `[low, high]` in seconds for a failure after `attempts_made` attempts.
    pub fn window(&self, attempts_made: u32) -> (f64, f64) {
        window(self.base, self.cap, attempts_made, self.jitter)
    }

    /// The delay before the retry, or `None` when backoff is off (base 0: keep the schedule).
    pub fn delay(&self, attempts_made: u32, rng: &mut dyn RandomSource) -> Option<Duration> {
        if self.base == 0.0 {
            return None;
        }
        let (lo, hi) = self.window(attempts_made);
        // A random source is user code: NaN counts as 0, anything else is clamped to [0, 1].
        let u = rng.unit();
        let u = if u.is_nan() { 0.0 } else { u.clamp(0.0, 1.0) };
        // lo and hi are within [0, cap] and cap is at most 365 days, so this cannot fail;
        // the cap is the answer if it ever did.
        Some(
            Duration::try_from_secs_f64(lo + (hi - lo) * u)
                .unwrap_or(Duration::from_secs_f64(self.cap)),
        )
    }
}

/// `min(cap, base × 2^a)` without overflow.
pub fn ceiling(base: f64, cap: f64, attempts_made: u32) -> f64 {
    // 2^1100 overflows f64 to infinity; min() with cap keeps it finite either way.
    let exp = attempts_made.min(1100) as i32;
    (base * 2f64.powi(exp)).min(cap)
}

/// The jitter window `[low, high]` in seconds (pure).
pub fn window(base: f64, cap: f64, attempts_made: u32, jitter: Jitter) -> (f64, f64) {
    let d = ceiling(base, cap, attempts_made);
    match jitter {
        Jitter::Equal => (d / 2.0, d),
        Jitter::Full => (0.0, d),
        Jitter::Decorrelated => {
            let prev = if attempts_made == 0 {
                base.min(cap)
            } else {
                ceiling(base, cap, attempts_made - 1)
            };
            let hi = (prev * 3.0).min(cap).max(base.min(cap));
            (base.min(cap), hi)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: [(u32, f64, f64); 10] = [
        (0, 5.0, 10.0),
        (1, 10.0, 20.0),
        (2, 20.0, 40.0),
        (3, 40.0, 80.0),
        (4, 80.0, 160.0),
        (5, 160.0, 320.0),
        (6, 320.0, 640.0),
        (7, 640.0, 1280.0),
        (8, 1280.0, 2560.0),
        (9, 1800.0, 3600.0),
    ];

    #[test]
    fn equal_jitter_matches_the_contract_table() {
        let b = Backoff::default();
        for (a, lo, hi) in TABLE {
            assert_eq!(
                b.delay(a, &mut Fixed(0.0)).unwrap().as_secs_f64(),
                lo,
                "a={a}"
            );
            assert_eq!(
                b.delay(a, &mut Fixed(1.0)).unwrap().as_secs_f64(),
                hi,
                "a={a}"
            );
        }
        for a in 9..=12 {
            assert_eq!(b.window(a), (1800.0, 3600.0));
        }
    }

    #[test]
    fn random_draws_stay_in_every_window_for_every_mode() {
        let mut rng = SeededRng::new(7);
        for jitter in [Jitter::Equal, Jitter::Full, Jitter::Decorrelated] {
            let b = Backoff::default().with_jitter(jitter);
            for a in 0..=12 {
                let (lo, hi) = b.window(a);
                assert!(lo <= hi);
                for _ in 0..2000 {
                    let d = b.delay(a, &mut rng).unwrap().as_secs_f64();
                    assert!(d >= lo - 1e-9 && d <= hi + 1e-9, "{jitter:?} a={a} d={d}");
                }
            }
        }
    }

    #[test]
    fn full_and_decorrelated_windows() {
        assert_eq!(window(10.0, 3600.0, 0, Jitter::Full), (0.0, 10.0));
        assert_eq!(window(10.0, 3600.0, 3, Jitter::Full), (0.0, 80.0));
        assert_eq!(window(10.0, 3600.0, 0, Jitter::Decorrelated), (10.0, 30.0));
        assert_eq!(window(10.0, 3600.0, 2, Jitter::Decorrelated), (10.0, 60.0));
        assert_eq!(
            window(10.0, 3600.0, 20, Jitter::Decorrelated),
            (10.0, 3600.0)
        );
    }

    #[test]
    fn with_jitter_sets_the_mode_and_its_window() {
        let b = Backoff::default();
        assert_eq!(b.jitter(), Jitter::Equal);
        let full = b.with_jitter(Jitter::Full);
        assert_eq!(full.jitter(), Jitter::Full);
        assert_eq!(full.window(3), (0.0, 80.0));
        let dec = b.with_jitter(Jitter::Decorrelated);
        assert_eq!(dec.window(2), (10.0, 60.0));
        assert_eq!((dec.base_seconds(), dec.cap_seconds()), (10.0, 3600.0));
    }

    #[test]
    fn cap_saturates_without_overflow() {
        let b = Backoff::new(1.0, 8.0).unwrap();
        assert_eq!(b.window(3), (4.0, 8.0));
        assert_eq!(b.window(4), (4.0, 8.0));
        assert_eq!(b.window(u32::MAX), (4.0, 8.0));
        assert_eq!(Backoff::default().window(u32::MAX), (1800.0, 3600.0));
    }

    #[test]
    fn base_zero_turns_backoff_off() {
        let b = Backoff::new(0.0, 3600.0).unwrap();
        assert_eq!(b.delay(0, &mut Fixed(0.5)), None);
        assert_eq!(b.delay(7, &mut Fixed(0.5)), None);
    }

    #[test]
    fn parameter_errors_use_the_ancestor_texts() {
        let e = Backoff::new(-1.0, 3600.0).unwrap_err();
        assert_eq!(
            e.to_string(),
            "retry_backoff_base_seconds must be >= 0, got -1"
        );
        let e = Backoff::new(10.0, 0.0).unwrap_err();
        assert_eq!(
            e.to_string(),
            "retry_backoff_cap_seconds must be > 0, got 0"
        );
        assert!(Backoff::new(f64::NAN, 1.0).is_err());
    }

    #[test]
    fn seeded_draws_are_deterministic() {
        let b = Backoff::default();
        let draw = |seed| {
            let mut r = SeededRng::new(seed);
            (0..10)
                .map(|a| b.delay(a, &mut r).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(42), draw(42));
        assert_ne!(draw(42), draw(43));
    }
}
