//! The event model's limits, at and past each edge.

use std::time::Duration;

use super::*;
use crate::error::ValidationError;
use serde_json::json;

fn base() -> EventBuilder {
    NewEvent::builder()
        .event_type("order.created")
        .aggregate("order", Uuid::new_v4())
        .topic("orders")
        .partition_key("k")
        .payload_json(json!({"n": 1}))
}

#[test]
fn string_limits_at_and_past_the_edge() {
    type Set = fn(EventBuilder, String) -> EventBuilder;
    let cases: [(&str, usize, Set); 9] = [
        ("event_type", limits::EVENT_TYPE_MAX, |b, v| b.event_type(v)),
        ("aggregate_type", limits::AGGREGATE_TYPE_MAX, |b, v| {
            b.aggregate(v, Uuid::nil())
        }),
        ("topic", limits::TOPIC_MAX, |b, v| b.topic(v)),
        ("partition_key", limits::PARTITION_KEY_MAX, |b, v| {
            b.partition_key(v)
        }),
        ("idempotency_key", limits::IDEMPOTENCY_KEY_MAX, |b, v| {
            b.idempotency_key(v)
        }),
        ("trace_id", limits::TRACE_ID_MAX, |b, v| b.trace_id(v)),
        ("correlation_id", limits::TRACE_ID_MAX, |b, v| {
            b.correlation_id(v)
        }),
        ("causation_id", limits::TRACE_ID_MAX, |b, v| {
            b.causation_id(v)
        }),
        ("schema_version", limits::SCHEMA_VERSION_MAX, |b, v| {
            b.schema_version(v)
        }),
    ];
    for (field, max, set) in cases {
        // Characters, not bytes: a two-byte character counts once.
        assert!(
            set(base(), "ü".repeat(max)).build().is_ok(),
            "{field} at {max}"
        );
        assert_eq!(
            set(base(), "ü".repeat(max + 1)).build().unwrap_err(),
            ValidationError::TooLong {
                field,
                max,
                actual: max + 1
            }
        );
        assert_eq!(
            set(base(), "  ".into()).build().unwrap_err(),
            ValidationError::Empty { field }
        );
        // Trimmed before counting.
        assert!(
            set(base(), format!(" {} ", "a".repeat(max)))
                .build()
                .is_ok()
        );
    }
}

#[test]
fn payload_limits() {
    let at = json!({ "x": "a".repeat(999_992) });
    assert!(base().payload_json(at).build().is_ok());
    let past = json!({ "x": "a".repeat(999_993) });
    assert_eq!(
        base().payload_json(past).build().unwrap_err(),
        ValidationError::PayloadTooLarge {
            bytes: 1_000_001,
            max: 1_000_000
        }
    );
    assert_eq!(
        base().payload_json(json!({})).build().unwrap_err(),
        ValidationError::PayloadEmpty
    );
    assert_eq!(
        base().payload_json(json!([1])).build().unwrap_err(),
        ValidationError::PayloadNotObject { kind: "array" }
    );
    #[derive(serde::Serialize)]
    struct P {
        v: Vec<f64>,
    }
    let e = base()
        .payload(&P {
            v: vec![1.0, f64::NEG_INFINITY],
        })
        .build()
        .unwrap_err();
    assert!(matches!(e, ValidationError::PayloadNotFinite { .. }), "{e}");
    assert!(base().payload(&P { v: vec![1.5] }).build().is_ok());
}

#[test]
fn header_limits() {
    let n = |n: usize| {
        (0..n)
            .map(|i| (format!("h{i}"), "v".to_string()))
            .collect::<Vec<_>>()
    };
    assert!(base().headers(n(100)).build().is_ok());
    assert_eq!(
        base().headers(n(101)).build().unwrap_err(),
        ValidationError::TooManyHeaders {
            count: 101,
            max: 100
        }
    );
    assert!(base().header("k".repeat(64), "v").build().is_ok());
    assert!(matches!(
        base().header("k".repeat(65), "v").build(),
        Err(ValidationError::Header { .. })
    ));
    assert!(base().header("k", "v".repeat(512)).build().is_ok());
    assert!(matches!(
        base().header("k", "v".repeat(513)).build(),
        Err(ValidationError::Header { .. })
    ));
    assert!(base().header("k", "a\tb").build().is_ok());
    for (k, v) in [
        ("k", "a\nb"),
        ("k\u{7f}", "v"),
        ("k\u{1}", "v"),
        ("k", "  "),
    ] {
        assert!(
            matches!(
                base().header(k, v).build(),
                Err(ValidationError::Header { .. })
            ),
            "{k:?}={v:?}"
        );
    }
    assert!(base().header("A", "1").header("a", "2").build().is_err());
    let e = base().header(" k ", " v ").build().unwrap();
    assert_eq!(e.headers().unwrap().get("k").map(String::as_str), Some("v"));
    assert!(
        base()
            .headers(Vec::<(String, String)>::new())
            .build()
            .unwrap()
            .headers()
            .is_none()
    );
}

#[test]
fn schedule_window() {
    use crate::clock::ManualClock;
    let t = Utc::now();
    let s = BuildSettings::new().with_clock(Arc::new(ManualClock::new(t)));
    let at = |secs: i64| {
        base()
            .scheduled_at(t + chrono::Duration::seconds(secs))
            .build_with(&s)
    };
    assert!(at(-60).is_ok());
    assert!(matches!(
        at(-61),
        Err(ValidationError::ScheduleOutOfWindow { .. })
    ));
    assert!(at(31_536_000).is_ok());
    assert!(matches!(
        at(31_536_001),
        Err(ValidationError::ScheduleOutOfWindow { .. })
    ));
    assert!(
        base()
            .delay(Duration::from_secs(31_536_000))
            .build()
            .is_ok()
    );
    assert!(matches!(
        base().delay(Duration::from_secs(31_536_001)).build(),
        Err(ValidationError::DelayOutOfRange { .. })
    ));
    assert!(matches!(
        base().delay_seconds(-1.0).build(),
        Err(ValidationError::DelayOutOfRange { .. })
    ));
    let s0 = BuildSettings::new()
        .with_clock(Arc::new(ManualClock::new(t)))
        .with_skew_seconds(0)
        .unwrap();
    assert!(
        base()
            .scheduled_at(t - chrono::Duration::seconds(1))
            .build_with(&s0)
            .is_err()
    );
    assert!(BuildSettings::new().with_skew_seconds(-1).is_err());
}

#[test]
fn max_attempts_and_missing_fields() {
    assert_eq!(base().max_attempts(0).build().unwrap().max_attempts(), 6);
    assert_eq!(base().build().unwrap().max_attempts(), 6);
    assert_eq!(base().max_attempts(1).build().unwrap().max_attempts(), 1);
    assert_eq!(
        base().max_attempts(-1).build().unwrap_err(),
        ValidationError::MaxAttempts(-1)
    );
    let e = NewEvent::builder().topic("t").build().unwrap_err();
    assert!(matches!(e, ValidationError::Missing { .. }));
}

#[test]
fn worker_ids() {
    assert_eq!(
        WorkerId::new("worker_1").unwrap_err().to_string(),
        "Invalid worker_id format: 'worker_1'"
    );
    assert!(WorkerId::new("").is_err());
    assert!(WorkerId::new("a".repeat(255)).is_ok());
    assert!(WorkerId::new("a".repeat(256)).is_err());
    assert_eq!(
        WorkerId::new(" relay-1:host/a.b ").unwrap().as_str(),
        "relay-1:host/a.b"
    );
    let g = WorkerId::generate();
    assert!(WorkerId::new(g.as_str()).is_ok());
    assert_ne!(g, WorkerId::generate());
}

#[test]
fn ancestor_whitespace_is_pythons_isspace_set() {
    // The code points for which Python 3's str.isspace() is true (checked over all of
    // Unicode with CPython 3): Unicode White_Space plus U+001C..U+001F.
    let python: Vec<u32> = [
        0x9, 0xa, 0xb, 0xc, 0xd, 0x1c, 0x1d, 0x1e, 0x1f, 0x20, 0x85, 0xa0,
    ]
    .into_iter()
    .chain([0x1680])
    .chain(0x2000..=0x200a)
    .chain([0x2028, 0x2029, 0x202f, 0x205f, 0x3000])
    .collect();
    let ours: Vec<u32> = (0..=0x10ffff)
        .filter_map(char::from_u32)
        .filter(|c| is_ancestor_whitespace(*c))
        .map(|c| c as u32)
        .collect();
    assert_eq!(ours, python);
    assert_eq!(trim_ancestor("\u{1f}\u{1c} k \u{3000}\u{1e}"), "k");
    assert_eq!(trim_ancestor("\u{200b}k"), "\u{200b}k");
}

#[test]
fn insert_window_is_checked_against_created_at() {
    let c = Utc::now();
    let id = Uuid::nil();
    let s = chrono::Duration::seconds;
    assert!(check_insert_window(id, c - s(60), c).is_ok());
    assert!(check_insert_window(id, c + s(31_536_000), c).is_ok());
    for at in [c - s(61), c + s(31_536_001)] {
        let e = check_insert_window(id, at, c).unwrap_err();
        assert_eq!(
            e,
            ValidationError::ScheduleOutsideInsertWindow {
                id,
                at,
                created_at: c
            }
        );
        assert!(e.to_string().contains("nothing was written"), "{e}");
    }
}

#[test]
fn traceparent_is_validated_and_stored_as_the_reserved_header() {
    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let e = base()
        .traceparent(TP)
        .header("tenant", "a")
        .build()
        .unwrap();
    assert_eq!(e.traceparent(), Some(TP));
    assert_eq!(
        e.headers().unwrap().get("traceparent").map(String::as_str),
        Some(TP)
    );
    let row = e.into_row(Utc::now());
    assert_eq!(row.traceparent(), Some(TP));
    // Through the header too, with the same check.
    assert_eq!(
        base()
            .header("traceparent", TP)
            .build()
            .unwrap()
            .traceparent(),
        Some(TP)
    );
    for b in [
        base().traceparent("not-a-trace"),
        base().header("traceparent", "00-xyz"),
        base().header("TraceParent", TP),
        base().traceparent(TP).header("traceparent", TP),
    ] {
        let err = b.build().unwrap_err();
        assert!(
            matches!(&err, ValidationError::Header { key, .. } if key.eq_ignore_ascii_case("traceparent")),
            "{err}"
        );
    }
    assert!(base().build().unwrap().traceparent().is_none());
}

#[test]
fn error_text_normalization() {
    let x = normalize_error(&"x".repeat(3000), 2000);
    assert_eq!(x.len(), 2000);
    assert!(x.ends_with(limits::TRUNCATED_SUFFIX));
    assert_eq!(normalize_error(&"é".repeat(1001), 2000).len(), 1999);
    assert_eq!(normalize_error(" ", 2000), "Unknown error");
    assert!(check_error_max_length(15).is_err());
    assert!(check_error_max_length(16).is_ok());
    assert_eq!(check_error_max_length(2000).unwrap(), 2000);
    let e = check_error_max_length(2001).unwrap_err().to_string();
    assert!(
        e.contains("at most 2000") && e.contains("last_error"),
        "{e}"
    );
    assert_eq!(force_unlock_text("  ops ").unwrap(), "Force unlock: ops");
    assert!(force_unlock_text("").is_err());
    assert!(force_unlock_text(&"a".repeat(256)).is_err());
    assert!(force_unlock_text(&"a".repeat(255)).is_ok());
}
