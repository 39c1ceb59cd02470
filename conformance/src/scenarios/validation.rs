//! V: validation. Every case checks that nothing is written on error.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde_json::{Value, json};
use txoutbox_core::clock::ManualClock;
use txoutbox_core::error::ValidationError;
use txoutbox_core::event::{BuildSettings, EventBuilder, NewEvent, WorkerId, normalize_error};
use txoutbox_core::repository::FetchRequest;
use uuid::Uuid;

use crate::ctx::Ctx;
use crate::harness::Factory;

fn base() -> EventBuilder {
    NewEvent::builder()
        .event_type("order.created")
        .aggregate("order", Uuid::new_v4())
        .topic("orders")
        .partition_key("k")
        .payload_json(json!({"n": 1}))
}

/// Builds, and for accepted events writes them, so a backend sees every accepted case;
/// rejected ones must leave the table as it was.
async fn check(
    c: &Ctx,
    b: EventBuilder,
    ok: bool,
    what: &str,
) -> Option<txoutbox_core::OutboxEvent> {
    let before = c.total_rows().await;
    match b.build() {
        Ok(e) => {
            assert!(ok, "{what}: accepted, expected rejection");
            Some(c.write(vec![e]).await.remove(0).event)
        }
        Err(err) => {
            assert!(!ok, "{what}: rejected with {err}, expected acceptance");
            let after = c.total_rows().await;
            assert_eq!(before, after, "{what}: a rejected event changed the table");
            None
        }
    }
}

fn headers(n: usize) -> Vec<(String, String)> {
    (0..n).map(|i| (format!("h{i}"), "v".to_string())).collect()
}

/// V-01 to V-12, V-15: every event limit at and past its edge.
pub async fn v_01_to_v_12(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    // V-01
    check(&c, base().payload_json(json!({})), false, "V-01 {}").await;
    check(&c, base().payload_json(json!([1, 2])), false, "V-01 [1,2]").await;
    // V-02
    let s = "a".repeat(999_992);
    let e = check(
        &c,
        base().payload_json(json!({ "x": s })),
        true,
        "V-02 1,000,000 bytes",
    )
    .await
    .unwrap();
    assert_eq!(serde_json::to_string(&e.payload).unwrap().len(), 1_000_000);
    let s = "a".repeat(999_993);
    check(
        &c,
        base().payload_json(json!({ "x": s })),
        false,
        "V-02 1,000,001 bytes",
    )
    .await;
    // V-03
    #[derive(Serialize)]
    struct P {
        x: f64,
    }
    for v in [f64::NAN, f64::INFINITY] {
        let err = base().payload(&P { x: v }).build().unwrap_err();
        assert!(
            matches!(err, ValidationError::PayloadNotFinite { .. }),
            "{err}"
        );
    }
    // V-04
    check(&c, base().headers(headers(100)), true, "V-04 100").await;
    check(&c, base().headers(headers(101)), false, "V-04 101").await;
    // V-05
    check(&c, base().header("k".repeat(64), "v"), true, "V-05 key 64").await;
    check(&c, base().header("k".repeat(65), "v"), false, "V-05 key 65").await;
    check(
        &c,
        base().header("k", "v".repeat(512)),
        true,
        "V-05 value 512",
    )
    .await;
    check(
        &c,
        base().header("k", "v".repeat(513)),
        false,
        "V-05 value 513",
    )
    .await;
    // V-06
    check(&c, base().header("k", "a\nb"), false, "V-06 newline").await;
    check(&c, base().header("k", "a\tb"), true, "V-06 tab").await;
    check(&c, base().header("k\u{7f}", "v"), false, "V-06 DEL in key").await;
    // V-07
    check(
        &c,
        base().header("A", "1").header("a", "2"),
        false,
        "V-07 case",
    )
    .await;
    check(
        &c,
        base().header(" k", "1").header("k", "2"),
        false,
        "V-07 trim",
    )
    .await;
    check(&c, base().header("k", "   "), false, "V-07 blank value").await;
    // V-08
    let e = check(
        &c,
        base().headers(Vec::<(String, String)>::new()),
        true,
        "V-08 {}",
    )
    .await
    .unwrap();
    assert!(e.headers.is_none());
    let e = check(&c, base().header(" k ", " v "), true, "V-08 trim")
        .await
        .unwrap();
    assert_eq!(serde_json::to_value(&e.headers).unwrap(), json!({"k": "v"}));
    // V-09 with a fixed builder clock.
    let t = chrono::Utc::now();
    let settings = BuildSettings::new().with_clock(Arc::new(ManualClock::new(t)));
    for (off, ok) in [
        (-61, false),
        (-60, true),
        (-59, true),
        (364 * 86_400, true),
        (365 * 86_400, true),
        (366 * 86_400, false),
    ] {
        let r = base()
            .scheduled_at(t + chrono::Duration::seconds(off))
            .build_with(&settings);
        assert_eq!(r.is_ok(), ok, "V-09 offset {off} s: {r:?}");
    }
    // V-10
    check(
        &c,
        base().delay(Duration::from_secs(31_536_000)),
        true,
        "V-10 365 d",
    )
    .await;
    check(
        &c,
        base().delay(Duration::from_secs(31_536_001)),
        false,
        "V-10 365 d + 1 s",
    )
    .await;
    // V-11
    type Set = fn(EventBuilder, String) -> EventBuilder;
    let fields: [(&str, usize, Set); 9] = [
        ("event_type", 100, |b, v| b.event_type(v)),
        ("aggregate_type", 50, |b, v| b.aggregate(v, Uuid::new_v4())),
        ("topic", 255, |b, v| b.topic(v)),
        ("partition_key", 255, |b, v| b.partition_key(v)),
        ("idempotency_key", 128, |b, v| b.idempotency_key(v)),
        ("trace_id", 64, |b, v| b.trace_id(v)),
        ("correlation_id", 64, |b, v| b.correlation_id(v)),
        ("causation_id", 64, |b, v| b.causation_id(v)),
        ("schema_version", 50, |b, v| b.schema_version(v)),
    ];
    for (name, max, set) in fields {
        let err = set(base(), "é".repeat(max + 1)).build().unwrap_err();
        assert!(
            matches!(err, ValidationError::TooLong { field, max: m, .. } if field == name && m == max),
            "V-11 {name}: {err}"
        );
        check(&c, set(base(), "é".repeat(max)), true, name).await;
    }
    // V-12
    check(&c, base().event_type("   "), false, "V-12 blank").await;
    let e = check(&c, base().event_type(" order.created "), true, "V-12 trim")
        .await
        .unwrap();
    assert_eq!(e.event_type, "order.created");
    let e = check(&c, base().idempotency_key(" ik "), true, "V-12 ik")
        .await
        .unwrap();
    assert_eq!(e.idempotency_key.as_deref(), Some("ik"));
    // V-15
    let e = check(&c, base().max_attempts(0), true, "V-15 0")
        .await
        .unwrap();
    assert_eq!(e.max_attempts, 6);
    let e = check(&c, base().max_attempts(1), true, "V-15 1")
        .await
        .unwrap();
    assert_eq!(e.max_attempts, 1);
}

/// V-13 Worker ids, at relay build and at fetch.
pub async fn v_13(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e = WorkerId::new("worker_1").unwrap_err();
    assert_eq!(e.to_string(), "Invalid worker_id format: 'worker_1'");
    let relay = txoutbox_core::Relay::builder(c.repo(), Arc::new(c.broker.clone()))
        .worker_id("worker_1")
        .build()
        .unwrap_err();
    assert_eq!(relay.to_string(), "Invalid worker_id format: 'worker_1'");
    assert!(WorkerId::new("").is_err());
    assert!(WorkerId::new("a".repeat(256)).is_err());
    assert!(WorkerId::new("a".repeat(255)).is_ok());
    let w = WorkerId::new("relay-1:host/a.b").unwrap();
    c.put(c.ev("k")).await;
    let got = c
        .repo()
        .fetch_and_lock(&FetchRequest::new(w, 10))
        .await
        .unwrap();
    assert_eq!(got.len(), 1);
}

/// V-14 Error texts are normalized (R9).
pub async fn v_14(f: &dyn Factory) {
    let _ = f;
    let x = normalize_error(&"x".repeat(3000), 2000);
    assert_eq!(x, format!("{}... [TRUNCATED]", "x".repeat(1985)));
    assert_eq!(x.len(), 2000);
    let e = "é".repeat(1000);
    assert_eq!(normalize_error(&e, 2000), e);
    let e = normalize_error(&"é".repeat(1001), 2000);
    assert_eq!(e, format!("{}... [TRUNCATED]", "é".repeat(992)));
    assert_eq!(e.len(), 1999);
    assert_eq!(normalize_error("   ", 2000), "Unknown error");
}

/// V-14 through a backend: a 3000-byte rejection text is stored truncated.
pub async fn v_14_stored(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let a = c.put(c.ev("k")).await;
    c.broker.script(
        a,
        [txoutbox_core::scripted::Action::Reject("x".repeat(3000))],
    );
    c.cycle1().await;
    let r = c.get(a).await;
    assert_eq!(
        r.last_error.unwrap(),
        format!("{}... [TRUNCATED]", "x".repeat(1985))
    );
    let b = c.put(c.ev("k2")).await;
    c.broker
        .script(b, [txoutbox_core::scripted::Action::Reject("   ".into())]);
    c.cycle1().await;
    assert_eq!(c.get(b).await.last_error.as_deref(), Some("Unknown error"));
}

/// V-16 Fetch arguments.
pub async fn v_16(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let id = c.put(c.ev("k")).await;
    let w = WorkerId::new("w1").unwrap();
    let e = c
        .repo()
        .fetch_and_lock(&FetchRequest::new(w.clone(), 0))
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("limit must be greater than 0"),
        "{e}"
    );
    let e = c
        .repo()
        .fetch_and_lock(&FetchRequest::new(w.clone(), 1).lease_ttl(Duration::ZERO))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("lease_ttl must be positive"), "{e}");
    assert!(
        c.repo()
            .fetch_and_lock(&FetchRequest::new(w, 1).max_per_key(0))
            .await
            .is_err()
    );
    assert!(
        c.get(id).await.locked_by.is_none(),
        "a rejected fetch locked a row"
    );
}

/// V-17 Backend and builder settings.
pub async fn v_17(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let r = |b, e| {
        c.h.try_configure(b, e)
            .expect("the backend must expose its settings to V-17")
    };
    assert!(r(0, 2000).is_err());
    assert!(r(1, 2000).is_ok());
    assert!(r(10_000, 2000).is_ok());
    assert!(r(10_001, 2000).is_err());
    assert!(r(1000, 15).is_err());
    assert!(r(1000, 16).is_ok());
    // The last_error column holds 2,000 bytes: a larger setting is refused (R9).
    assert!(r(1000, 2000).is_ok());
    assert!(r(1000, 2001).is_err());
    assert!(BuildSettings::new().with_skew_seconds(-1).is_err());
    assert!(BuildSettings::new().with_skew_seconds(0).is_ok());
    let _: Value = json!(null);
}

/// V-18 Header keys hold no control character anywhere, TAB included; values none but TAB (R6).
pub async fn v_18(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    for cp in (0u32..32).chain([127]) {
        let ch = char::from_u32(cp).unwrap();
        check(
            &c,
            base().header(format!("a{ch}b"), "v"),
            false,
            &format!("V-18 key with U+{cp:04X} inside"),
        )
        .await;
        check(
            &c,
            base().header("k", format!("a{ch}b")),
            ch == '\t',
            &format!("V-18 value with U+{cp:04X} inside"),
        )
        .await;
    }
}

/// Every character the ancestor (Python's `str.strip()`) treats as whitespace.
pub const ANCESTOR_WHITESPACE: [char; 29] = [
    '\u{9}', '\u{a}', '\u{b}', '\u{c}', '\u{d}', '\u{1c}', '\u{1d}', '\u{1e}', '\u{1f}', ' ',
    '\u{85}', '\u{a0}', '\u{1680}', '\u{2000}', '\u{2001}', '\u{2002}', '\u{2003}', '\u{2004}',
    '\u{2005}', '\u{2006}', '\u{2007}', '\u{2008}', '\u{2009}', '\u{200a}', '\u{2028}', '\u{2029}',
    '\u{202f}', '\u{205f}', '\u{3000}',
];

/// V-19 Trimming uses the ancestor's whitespace set (Python's `str.strip()`), U+001C to U+001F
/// included, on every trimmed text (R6, R7, R9, R10, R66).
pub async fn v_19(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    for ws in ANCESTOR_WHITESPACE {
        let what = format!("U+{:04X}", ws as u32);
        check(
            &c,
            base().trace_id(ws.to_string()),
            false,
            &format!("V-19 trace_id {what}"),
        )
        .await;
        check(
            &c,
            base().event_type(format!("{ws}{ws}")),
            false,
            &format!("V-19 event_type {what}"),
        )
        .await;
        let e = check(
            &c,
            base()
                .partition_key(format!("k{ws}"))
                .idempotency_key(format!("{ws}ik-{}", ws as u32))
                .header(format!("{ws}h{ws}"), format!("v{ws}")),
            true,
            &format!("V-19 trimmed {what}"),
        )
        .await
        .unwrap();
        assert_eq!(e.partition_key, "k", "{what}");
        assert_eq!(
            e.idempotency_key,
            Some(format!("ik-{}", ws as u32)),
            "{what}"
        );
        assert_eq!(
            serde_json::to_value(&e.headers).unwrap(),
            json!({"h": "v"}),
            "{what}"
        );
        assert_eq!(normalize_error(&format!("{ws}x{ws}"), 2000), "x", "{what}");
        assert_eq!(
            normalize_error(&ws.to_string(), 2000),
            "Unknown error",
            "{what}"
        );
        assert_eq!(
            WorkerId::new(format!("w1{ws}")).unwrap().as_str(),
            "w1",
            "{what}"
        );
    }
    // Characters Python does not strip stay: U+200B (zero width space), U+180E, U+FEFF.
    for keep in ['\u{200b}', '\u{180e}', '\u{feff}'] {
        let e = check(
            &c,
            base().partition_key(format!("k{keep}")),
            true,
            "V-19 kept",
        )
        .await
        .unwrap();
        assert_eq!(e.partition_key, format!("k{keep}"));
    }
    // A force-unlock reason of ancestor whitespace only is empty.
    let a = c.put(c.ev("fu")).await;
    c.set(a, crate::RowPatch::held("w1", c.now().await)).await;
    assert!(c.repo().force_unlock(a, "\u{1f}\u{1c}").await.is_err());
    c.repo().force_unlock(a, "\u{1e}ops\u{1d}").await.unwrap();
    assert_eq!(
        c.get(a).await.last_error.as_deref(),
        Some("Force unlock: ops")
    );
}
