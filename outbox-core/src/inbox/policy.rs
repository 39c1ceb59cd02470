//! The failure policy (contract R123 to R131): who retries a failed handler run, and the pure
//! decisions that follow from it.
//!
//! * `on_failure = record` (the default, D33): the failure is written into the row (R126) and a
//!   processor retries it with the outbox's backoff, budget and terminal state;
//! * `on_failure = rewind`: the delivery goes back to the broker with a delay (R127), within the
//!   attempt budget of R128;
//! * `at_most_once`: the delivery is committed before it is handled and nothing retries a failed
//!   run (R129).
//!
//! The ancestor's `ack_strategy`, `commit_offset_policy` and `exactly_once_commit_on_failed`
//! are accepted as aliases ([`resolve`]). Every function here is pure: times and random draws
//! come in as arguments. Checked by conformance scenarios N-01 to N-13, F-02 to F-08, F-18,
//! F-25.

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::backoff::{Backoff, RandomSource, TRANSIENT_RETRY};
use crate::error::ConfigError;
use crate::event::limits;
use crate::inbox::handler::{Failure, FailureClass};
use crate::inbox::repository::RowWrite;
use crate::repository::{OnExhausted, Retry};

/// Who retries a failed handler run (R123).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnFailure {
    /// The inbox: the failure is recorded in the row (R126). The default.
    #[default]
    Record,
    /// The broker: the delivery is rewound with a delay (R127).
    Rewind,
}

/// The resolved delivery policy of a runner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FailurePolicy {
    /// Who retries (not read under at_most_once).
    pub on_failure: OnFailure,
    /// Commit before handling; nothing retries (R129).
    pub at_most_once: bool,
}

/// The ancestor's ack strategy (an alias, R123).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AckStrategy {
    /// `at_most_once`.
    AtMostOnce,
    /// `at_least_once`.
    AtLeastOnce,
    /// `exactly_once_inbox` (the ancestor's default).
    ExactlyOnceInbox,
}

impl std::str::FromStr for AckStrategy {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, ConfigError> {
        match s {
            "at_most_once" => Ok(Self::AtMostOnce),
            "at_least_once" => Ok(Self::AtLeastOnce),
            "exactly_once_inbox" => Ok(Self::ExactlyOnceInbox),
            o => Err(ConfigError::new(format!(
                "unknown ack_strategy {o:?}: use at_most_once, at_least_once or exactly_once_inbox"
            ))),
        }
    }
}

/// The ancestor's commit offset policy (an alias, read only under at_least_once).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommitOffsetPolicy {
    /// `on_persist`: commit once the row is stored (record).
    OnPersist,
    /// `on_success`: commit only after a success (rewind).
    OnSuccess,
}

impl std::str::FromStr for CommitOffsetPolicy {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, ConfigError> {
        match s {
            "on_persist" => Ok(Self::OnPersist),
            "on_success" => Ok(Self::OnSuccess),
            o => Err(ConfigError::new(format!(
                "unknown commit_offset_policy {o:?}: use on_persist or on_success"
            ))),
        }
    }
}

/// The ancestor's three settings, each optional.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AncestorAckSettings {
    /// ack_strategy.
    pub ack_strategy: Option<AckStrategy>,
    /// commit_offset_policy.
    pub commit_offset_policy: Option<CommitOffsetPolicy>,
    /// exactly_once_commit_on_failed.
    pub exactly_once_commit_on_failed: Option<bool>,
}

impl AncestorAckSettings {
    fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// Resolves the settings of R123: this library's `on_failure` and `at_most_once`, or the
/// ancestor's aliases, never both (F-18).
pub fn resolve(
    on_failure: Option<OnFailure>,
    at_most_once: Option<bool>,
    ancestor: AncestorAckSettings,
) -> Result<FailurePolicy, ConfigError> {
    if !ancestor.is_empty() {
        if on_failure.is_some() || at_most_once.is_some() {
            return Err(ConfigError::new(
                "give on_failure and at_most_once, or the ancestor's ack settings, not both",
            ));
        }
        let record = FailurePolicy {
            on_failure: OnFailure::Record,
            at_most_once: false,
        };
        let rewind = FailurePolicy {
            on_failure: OnFailure::Rewind,
            at_most_once: false,
        };
        return Ok(
            match ancestor
                .ack_strategy
                .unwrap_or(AckStrategy::ExactlyOnceInbox)
            {
                AckStrategy::AtMostOnce => FailurePolicy {
                    on_failure: OnFailure::Record,
                    at_most_once: true,
                },
                AckStrategy::AtLeastOnce => match ancestor
                    .commit_offset_policy
                    .unwrap_or(CommitOffsetPolicy::OnPersist)
                {
                    CommitOffsetPolicy::OnPersist => record,
                    CommitOffsetPolicy::OnSuccess => rewind,
                },
                AckStrategy::ExactlyOnceInbox => {
                    if ancestor.exactly_once_commit_on_failed.unwrap_or(true) {
                        record
                    } else {
                        rewind
                    }
                }
            },
        );
    }
    Ok(FailurePolicy {
        on_failure: on_failure.unwrap_or_default(),
        at_most_once: at_most_once.unwrap_or(false),
    })
}

/// An explicit retry time as R44 accepts it: within [created_at, created_at + 365 days].
pub fn valid_explicit(at: DateTime<Utc>, created_at: DateTime<Utc>) -> Option<DateTime<Utc>> {
    let latest = created_at + chrono::Duration::seconds(limits::SCHEDULE_MAX_AHEAD_SECS);
    (at >= created_at && at <= latest).then_some(at)
}

/// The next try of a counted failure without an explicit time: the backoff of R39 after
/// `attempts_made` attempts.
pub fn backoff_retry(attempts_made: i32, backoff: &Backoff, rng: &mut dyn RandomSource) -> Retry {
    match backoff.delay(attempts_made.max(0) as u32, rng) {
        Some(d) => Retry::After(d),
        None => Retry::Keep,
    }
}

/// The write that records a failure in the row (R126, R154): counted as R38 (backoff R39,
/// explicit time R44), transient as R43, not counted with a time as R44 and without one as R43
/// (now + 1.0 s, D39). Under at_most_once every failure is counted (R129). `exhausted` is the
/// worker's `on_exhausted` (R191), ignored under at_most_once.
pub fn record_write(
    failure: &Failure,
    attempts_made: i32,
    created_at: DateTime<Utc>,
    backoff: &Backoff,
    rng: &mut dyn RandomSource,
    at_most_once: bool,
    exhausted: OnExhausted,
) -> RowWrite {
    let error = failure.error.clone();
    // Under at_most_once a failure always writes `failed` (R129, R191).
    let exhausted = if at_most_once {
        OnExhausted::Release
    } else {
        exhausted
    };
    let counted = |at: Option<DateTime<Utc>>, rng: &mut dyn RandomSource| {
        let retry = match at.and_then(|t| valid_explicit(t, created_at)) {
            Some(t) => Retry::At(t),
            None => backoff_retry(attempts_made, backoff, rng),
        };
        RowWrite::Counted {
            error: error.clone(),
            retry,
            exhausted,
        }
    };
    if at_most_once {
        let at = match failure.class {
            FailureClass::Counted { at } | FailureClass::NotCounted { at } => at,
            FailureClass::Transient => None,
        };
        return counted(at, rng);
    }
    match failure.class {
        FailureClass::Counted { at } => counted(at, rng),
        FailureClass::NotCounted { at: Some(t) } => match valid_explicit(t, created_at) {
            Some(t) => RowWrite::NotCounted {
                error,
                retry: Retry::At(t),
            },
            None => RowWrite::NotCounted {
                error,
                retry: Retry::After(TRANSIENT_RETRY),
            },
        },
        FailureClass::NotCounted { at: None } | FailureClass::Transient => RowWrite::NotCounted {
            error,
            retry: Retry::After(TRANSIENT_RETRY),
        },
    }
}

/// What the rewind path does with a failed run (R127, R128).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RewindDecision {
    /// Roll T back and rewind the delivery with this delay.
    Rewind(Duration),
    /// Record the failure in the row instead (R126's write).
    Record,
    /// Record the row as `failed` (R128).
    Terminal,
}

/// The rewind path's decision for a failure on delivery `n` (R127, R128): a counted failure
/// with n ≥ max_attempts, and any failure on the last delivery, ends the message; the failure
/// of a row that existed before T, and a delay beyond the backoff cap, are recorded; otherwise
/// the delivery is rewound by the backoff with a = n − 1, by `at − now`, or by 1.0 s.
#[allow(clippy::too_many_arguments)]
pub fn rewind_decision(
    failure: &Failure,
    n: u32,
    max_attempts: i32,
    last_delivery: bool,
    inserted: bool,
    now: DateTime<Utc>,
    backoff: &Backoff,
    rng: &mut dyn RandomSource,
) -> RewindDecision {
    let counted = matches!(failure.class, FailureClass::Counted { .. });
    if last_delivery || (counted && i64::from(n) >= i64::from(max_attempts)) {
        return RewindDecision::Terminal;
    }
    if !inserted {
        return RewindDecision::Record;
    }
    let at = match failure.class {
        FailureClass::Counted { at } | FailureClass::NotCounted { at } => at,
        FailureClass::Transient => None,
    };
    let delay = match (at, counted) {
        (Some(t), _) => (t - now).to_std().unwrap_or_default(),
        (None, true) => backoff
            .delay(n.saturating_sub(1), rng)
            .unwrap_or(Duration::ZERO),
        (None, false) => TRANSIENT_RETRY,
    };
    if delay.as_secs_f64() > backoff.cap_seconds() {
        RewindDecision::Record
    } else {
        RewindDecision::Rewind(delay)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backoff::Fixed;

    fn fail(class: FailureClass) -> Failure {
        Failure {
            error: "boom".into(),
            class,
        }
    }

    #[test]
    fn aliases() {
        let a = |s: Option<AckStrategy>, c: Option<CommitOffsetPolicy>, f: Option<bool>| {
            resolve(
                None,
                None,
                AncestorAckSettings {
                    ack_strategy: s,
                    commit_offset_policy: c,
                    exactly_once_commit_on_failed: f,
                },
            )
            .unwrap()
        };
        use AckStrategy::*;
        assert_eq!(
            a(Some(ExactlyOnceInbox), None, None).on_failure,
            OnFailure::Record
        );
        assert_eq!(
            a(Some(ExactlyOnceInbox), None, Some(false)).on_failure,
            OnFailure::Rewind
        );
        assert_eq!(
            a(Some(AtLeastOnce), None, None).on_failure,
            OnFailure::Record
        );
        assert_eq!(
            a(Some(AtLeastOnce), Some(CommitOffsetPolicy::OnSuccess), None).on_failure,
            OnFailure::Rewind
        );
        assert!(a(Some(AtMostOnce), None, None).at_most_once);
        let e = resolve(
            Some(OnFailure::Rewind),
            None,
            AncestorAckSettings {
                ack_strategy: Some(AtLeastOnce),
                ..Default::default()
            },
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "give on_failure and at_most_once, or the ancestor's ack settings, not both"
        );
        assert_eq!(
            resolve(None, None, Default::default()).unwrap(),
            FailurePolicy::default()
        );
    }

    #[test]
    fn rewind_delays_and_budget() {
        let b = Backoff::default();
        let now = Utc::now();
        let f = fail(FailureClass::Counted { at: None });
        for (n, lo) in [(1u32, 5.0), (2, 10.0), (5, 80.0)] {
            let d = rewind_decision(&f, n, 6, false, true, now, &b, &mut Fixed(0.0));
            assert_eq!(d, RewindDecision::Rewind(Duration::from_secs_f64(lo)));
        }
        assert_eq!(
            rewind_decision(&f, 6, 6, false, true, now, &b, &mut Fixed(0.0)),
            RewindDecision::Terminal
        );
        let t = fail(FailureClass::Transient);
        assert_eq!(
            rewind_decision(&t, 8, 6, false, true, now, &b, &mut Fixed(0.0)),
            RewindDecision::Rewind(TRANSIENT_RETRY)
        );
        assert_eq!(
            rewind_decision(&t, 9, 6, true, true, now, &b, &mut Fixed(0.0)),
            RewindDecision::Terminal
        );
        assert_eq!(
            rewind_decision(&f, 1, 6, false, false, now, &b, &mut Fixed(0.0)),
            RewindDecision::Record
        );
        let far = fail(FailureClass::NotCounted {
            at: Some(now + chrono::Duration::hours(2)),
        });
        assert_eq!(
            rewind_decision(&far, 1, 6, false, true, now, &b, &mut Fixed(0.0)),
            RewindDecision::Record
        );
        let zero = Backoff::new(0.0, 3600.0).unwrap();
        assert_eq!(
            rewind_decision(&f, 3, 6, false, true, now, &zero, &mut Fixed(0.5)),
            RewindDecision::Rewind(Duration::ZERO)
        );
    }

    #[test]
    fn recorded_writes() {
        let b = Backoff::default();
        let now = Utc::now();
        let w = record_write(
            &fail(FailureClass::Transient),
            0,
            now,
            &b,
            &mut Fixed(0.0),
            false,
            OnExhausted::Release,
        );
        assert_eq!(
            w,
            RowWrite::NotCounted {
                error: "boom".into(),
                retry: Retry::After(TRANSIENT_RETRY)
            }
        );
        let w = record_write(
            &fail(FailureClass::Transient),
            0,
            now,
            &b,
            &mut Fixed(0.0),
            true,
            OnExhausted::Park,
        );
        // Under at_most_once a failure always writes `failed` (R129, R191).
        assert!(matches!(
            w,
            RowWrite::Counted {
                exhausted: OnExhausted::Release,
                ..
            }
        ));
        let at = now + chrono::Duration::seconds(42);
        let w = record_write(
            &fail(FailureClass::NotCounted { at: Some(at) }),
            0,
            now,
            &b,
            &mut Fixed(0.0),
            false,
            OnExhausted::Release,
        );
        assert_eq!(
            w,
            RowWrite::NotCounted {
                error: "boom".into(),
                retry: Retry::At(at)
            }
        );
    }
}
