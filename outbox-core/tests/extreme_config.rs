//! Extreme values given to every public constructor and builder of outbox-core return
//! a value or a clear error, never a panic; and what they accept runs a cycle without one.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use proptest::prelude::*;
use serde_json::json;
use txoutbox_core::backoff::{Backoff, Fixed, Jitter, RandomSource};
use txoutbox_core::clock::{ManualClock, ManualRelayClock, RelayClock};
use txoutbox_core::event::{
    BuildSettings, NewEvent, WorkerId, check_error_max_length, force_unlock_text, limits,
};
use txoutbox_core::memory::MemoryConfig;
use txoutbox_core::relay::{BreakerConfig, Relay};
use txoutbox_core::repository::{FetchRequest, OutboxRepository, args, check_backend_batch_size};
use txoutbox_core::scripted::ScriptedBroker;
use txoutbox_core::{CancellationToken, InMemoryRepository};
use uuid::Uuid;

/// f64 values that break arithmetic: huge, tiny, negative, NaN, the infinities, and any value.
fn extreme_f64() -> impl Strategy<Value = f64> {
    prop_oneof![
        Just(f64::NAN),
        Just(f64::INFINITY),
        Just(f64::NEG_INFINITY),
        Just(f64::MAX),
        Just(f64::MIN_POSITIVE),
        Just(1e20),
        Just(1e300),
        Just(-0.0),
        Just(31_536_000.0),
        Just(31_536_000.000_001),
        0.0..1e4,
        any::<f64>(),
    ]
}

/// Durations from zero to `Duration::MAX`, with the edges over-represented.
fn extreme_duration() -> impl Strategy<Value = Duration> {
    prop_oneof![
        Just(Duration::ZERO),
        Just(Duration::MAX),
        Just(Duration::from_secs(u64::MAX / 2)),
        Just(Duration::from_secs(limits::SETTING_MAX_SECS)),
        Just(Duration::from_secs(limits::SETTING_MAX_SECS) + Duration::from_nanos(1)),
        (0u64..100_000).prop_map(Duration::from_millis),
        (any::<u64>(), 0u32..1_000_000_000).prop_map(|(s, n)| Duration::new(s, n)),
    ]
}

fn extreme_usize() -> impl Strategy<Value = usize> {
    prop_oneof![
        Just(0),
        Just(1),
        Just(usize::MAX),
        0usize..200,
        any::<usize>()
    ]
}

/// Any instant chrono can hold, the ends included.
fn extreme_time() -> impl Strategy<Value = DateTime<Utc>> {
    let min = DateTime::<Utc>::MIN_UTC.timestamp();
    let max = DateTime::<Utc>::MAX_UTC.timestamp();
    prop_oneof![
        Just(DateTime::<Utc>::MIN_UTC),
        Just(DateTime::<Utc>::MAX_UTC),
        Just(Utc::now()),
        (min..=max).prop_map(|s| Utc.timestamp_opt(s, 0).single().expect("in range")),
    ]
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("runtime")
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn backoff_settings_are_checked_and_every_accepted_one_gives_a_delay(
        base in extreme_f64(),
        cap in extreme_f64(),
        attempts in any::<u32>(),
        unit in extreme_f64(),
        jitter in prop_oneof![Just(Jitter::Equal), Just(Jitter::Full), Just(Jitter::Decorrelated)],
    ) {
        match Backoff::new(base, cap) {
            Ok(b) => {
                prop_assert!(cap <= limits::SETTING_MAX_SECS as f64);
                let b = b.with_jitter(jitter);
                // A random source is user code: NaN or out-of-range values must not panic.
                if let Some(d) = b.delay(attempts, &mut Fixed(unit)) {
                    prop_assert!(d.as_secs_f64() <= cap + 1e-6, "{d:?} over cap {cap}");
                }
                let mut nan = NanSource;
                let _ = b.delay(attempts, &mut nan);
            }
            Err(e) => prop_assert!(e.to_string().starts_with("retry_backoff_"), "{e}"),
        }
    }

    #[test]
    fn breaker_settings_are_checked(threshold in any::<i64>(), recovery in extreme_f64()) {
        match BreakerConfig::new(threshold, recovery) {
            Ok(_) => prop_assert!(threshold >= 1 && (0.0..=limits::SETTING_MAX_SECS as f64).contains(&recovery)),
            Err(e) => {
                let t = e.to_string();
                prop_assert!(t.contains("failure_threshold") || t.contains("recovery_timeout"), "{t}");
            }
        }
    }

    #[test]
    fn relay_settings_are_checked_and_an_accepted_relay_runs_a_cycle(
        lease in extreme_duration(),
        timeout in extreme_duration(),
        poll in extreme_duration(),
        idle in extreme_duration(),
        batch in extreme_usize(),
        per_key in extreme_usize(),
        concurrency in extreme_usize(),
        recovery in extreme_f64(),
        unit in extreme_f64(),
        worker in prop_oneof![Just("w1".to_owned()), any::<String>()],
    ) {
        let rt = runtime();
        rt.block_on(async {
            let repo = InMemoryRepository::new(Arc::new(ManualClock::starting_now()));
            repo.write_committed(vec![event("k")]).await.unwrap();
            let mut b = Relay::builder(Arc::new(repo.clone()), Arc::new(ScriptedBroker::new()))
                .worker_id(worker)
                .lease_ttl(lease)
                .publish_timeout(timeout)
                .poll_interval(poll)
                .idle_backoff_max(idle)
                .batch_size(batch)
                .max_per_key(per_key)
                .publish_concurrency(concurrency)
                .random_source(Box::new(Fixed(unit)))
                .clock(Arc::new(ManualRelayClock::new()));
            if let Ok(br) = BreakerConfig::new(1, recovery) {
                b = b.breaker(br);
            }
            match b.build() {
                Ok(relay) => {
                    let r = relay.cycle(&CancellationToken::new()).await;
                    assert!(r.is_ok(), "{r:?}");
                }
                Err(e) => assert!(!e.to_string().is_empty()),
            }
        });
    }

    #[test]
    fn memory_backend_takes_any_argument_without_panicking(
        lease in extreme_duration(),
        limit in extreme_usize(),
        per_key in extreme_usize(),
        stale in extreme_duration(),
        retention in any::<u32>(),
        cleanup_batch in extreme_usize(),
        blocked_limit in extreme_usize(),
        batch_size in extreme_usize(),
        error_max in extreme_usize(),
        start in extreme_time(),
        advance in extreme_duration(),
    ) {
        let rt = runtime();
        rt.block_on(async {
            let _ = MemoryConfig::default().batch_size(batch_size);
            let _ = MemoryConfig::default().error_max_length(error_max);
            let clock = ManualClock::new(start);
            let repo = InMemoryRepository::new(Arc::new(clock.clone()));
            let _ = repo.write_committed(vec![event("k")]).await;
            let w = WorkerId::new("w1").unwrap();
            let req = FetchRequest::new(w.clone(), limit).max_per_key(per_key).lease_ttl(lease);
            let fetched = repo.fetch_and_lock(&req).await;
            if lease > Duration::from_secs(limits::SETTING_MAX_SECS) {
                assert!(fetched.is_err(), "a lease over 365 days was accepted");
            }
            clock.advance(advance);
            let _ = repo.fetch_and_lock(&FetchRequest::new(w.clone(), 10)).await;
            let _ = repo.release_stale_locks(stale).await;
            let _ = repo.delete_old_completed(retention, cleanup_batch).await;
            let _ = repo.cleanup_old_events(retention, cleanup_batch, 3).await;
            let _ = repo.blocked_keys(lease, blocked_limit).await;
            let _ = repo.oldest_due_age().await;
            let _ = repo.counts().await;
        });
    }

    #[test]
    fn event_builder_takes_any_schedule_without_panicking(
        delay in extreme_duration(),
        delay_secs in extreme_f64(),
        at in extreme_time(),
        clock_at in extreme_time(),
        skew in any::<i64>(),
        max_attempts in any::<i64>(),
        created in extreme_time(),
    ) {
        let settings = match BuildSettings::new()
            .with_clock(Arc::new(ManualClock::new(clock_at)))
            .with_skew_seconds(skew)
        {
            Ok(s) => s,
            Err(e) => {
                prop_assert!(e.to_string().contains("scheduled_at_skew_seconds"));
                BuildSettings::new().with_clock(Arc::new(ManualClock::new(clock_at)))
            }
        };
        for b in [
            base().delay(delay),
            base().delay_seconds(delay_secs),
            base().scheduled_at(at),
            base().max_attempts(max_attempts),
        ] {
            if let Ok(ev) = b.build_with(&settings) {
                let _ = ev.into_row(created);
            }
        }
    }

    #[test]
    fn small_checks_take_any_value(
        n in extreme_usize(),
        text in any::<String>(),
        timeout in extreme_duration(),
        retention in any::<u32>(),
        offset in extreme_duration(),
        unit in extreme_f64(),
    ) {
        let _ = check_backend_batch_size(n);
        let _ = check_error_max_length(n);
        let _ = WorkerId::new(&text);
        let _ = force_unlock_text(&text);
        let _ = args::stale_timeout(timeout);
        let _ = args::cleanup(retention, n);
        let u = Fixed(unit).unit();
        prop_assert!(u.is_nan() || (0.0..=1.0).contains(&u));
        let c = ManualRelayClock::new();
        c.advance(offset);
        c.advance(offset);
        let _ = c.now();
    }
}

/// A random source that returns NaN (user code can).
struct NanSource;

impl RandomSource for NanSource {
    fn unit(&mut self) -> f64 {
        f64::NAN
    }
}

fn base() -> txoutbox_core::EventBuilder {
    NewEvent::builder()
        .event_type("test.event")
        .aggregate("agg", Uuid::new_v4())
        .topic("t")
        .partition_key("k")
        .payload_json(json!({ "n": 1 }))
}

fn event(key: &str) -> NewEvent {
    base().partition_key(key).build().unwrap()
}

/// Values that used to overflow (a 1e20 s recovery, a huge backoff cap, a huge lease), as plain
/// examples.
#[test]
fn overflowing_values_are_configuration_errors() {
    let e = BreakerConfig::new(5, 1e20).unwrap_err();
    assert_eq!(
        e.to_string(),
        "recovery_timeout must be at most 31536000 s (365 days), got 100000000000000000000"
    );
    let e = Backoff::new(10.0, 1e20).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("retry_backoff_cap_seconds must be at most 31536000"),
        "{e}"
    );
    let repo = InMemoryRepository::new(Arc::new(ManualClock::starting_now()));
    let e = Relay::builder(Arc::new(repo), Arc::new(ScriptedBroker::new()))
        .lease_ttl(Duration::MAX)
        .build()
        .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("lease_ttl must be at most 31536000 s"),
        "{e}"
    );
}

/// Found by the property test above: a publish concurrency beyond the semaphore's limit
/// (2^61 permits) panicked in the first cycle; it is a configuration error now.
#[test]
fn a_publish_concurrency_beyond_the_limit_is_a_configuration_error() {
    use txoutbox_core::relay::MAX_PUBLISH_CONCURRENCY;
    let repo = InMemoryRepository::new(Arc::new(ManualClock::starting_now()));
    let builder = || Relay::builder(Arc::new(repo.clone()), Arc::new(ScriptedBroker::new()));
    let e = builder()
        .publish_concurrency(usize::MAX)
        .build()
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "publish_concurrency must be between 1 and {MAX_PUBLISH_CONCURRENCY}, got {}",
            usize::MAX
        )
    );
    assert!(
        builder()
            .publish_concurrency(MAX_PUBLISH_CONCURRENCY + 1)
            .build()
            .is_err()
    );
    assert!(
        builder()
            .publish_concurrency(MAX_PUBLISH_CONCURRENCY)
            .build()
            .is_ok()
    );
}
