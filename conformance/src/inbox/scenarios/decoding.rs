//! E: decoding and bad input (scenarios.md section 25; E-14 is `[pg]`).

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::json;
use txoutbox_core::event::Status;
use txoutbox_core::inbox::decode::{AmqpValue, BrokerMessage};
use txoutbox_core::inbox::repository::{InboxBackend, InboxRepository, InboxTransaction};
use txoutbox_core::inbox::scripted::AckOp;
use txoutbox_core::inbox::{DeliveryOutcome as O, InboxEvent, NewInboxEvent, OnFailure};

use crate::inbox::ctx::{Ictx, g};
use crate::inbox::harness::{InboxFactory, InboxHarness};

type Headers<'a> = Vec<(&'a str, &'a str)>;

const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// Lands one message through a runner without a handler: the row, or the invalid reason.
async fn land_msg<H: InboxHarness>(
    c: &Ictx<H>,
    m: BrokerMessage,
    require_id: bool,
) -> Result<InboxEvent, String> {
    c.sub.push(m);
    let r = c
        .bare_runner()
        .require_message_id(require_id)
        .build()
        .unwrap();
    let res = c.handle(&r).await;
    if res.outcome == O::Invalid {
        return Err(res.error.unwrap_or_default());
    }
    assert_eq!(res.outcome, O::Landed, "{res:?}");
    Ok(c.backend().get(res.row_id.unwrap()).await.unwrap().unwrap())
}

fn own(h: &[(&str, &str)]) -> Vec<(String, String)> {
    h.iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// E-01: a message from this library's outbox lands with its columns and exactly its headers
/// (R137, R141).
pub async fn e_01<F: InboxFactory>(f: &F) {
    let u = uuid::Uuid::now_v7().to_string();
    let agg = uuid::Uuid::new_v4().to_string();
    let attrs = [
        ("event_id", u.as_str()),
        ("event_type", "order.paid"),
        ("topic", "orders"),
        ("partition_key", "acct-1"),
        ("aggregate_type", "order"),
        ("aggregate_id", agg.as_str()),
        ("created_at", "2026-12-01T10:15:30.123456Z"),
        ("trace_id", "tr-1"),
        ("schema_version", "1.0.0"),
        ("correlation_id", "c-1"),
    ];
    for redis in [false, true] {
        let c = Ictx::new(f).await;
        let m = if redis {
            let hj = json!({"tenant": "acme", "traceparent": TP}).to_string();
            let mut fields: Vec<(&str, &str)> = attrs.to_vec();
            fields.push(("payload", "{\"n\": 1}"));
            fields.push(("headers", hj.as_str()));
            fields.push(("x-extra", "1"));
            c.msgs.redis(&fields)
        } else {
            let mut h: Vec<(&str, &str)> = attrs.to_vec();
            h.extend([
                ("tenant", "acme"),
                ("traceparent", TP),
                ("Nats-Msg-Id", u.as_str()),
                ("Nats-Expected-Stream", "S"),
            ]);
            c.msgs.nats(&h, "{\"n\": 1}")
        };
        let row = land_msg(&c, m, false).await.expect("landed");
        assert_eq!(row.message_id, u);
        assert_eq!(
            (row.source.as_str(), row.event_type.as_str()),
            ("orders", "order.paid")
        );
        assert_eq!(row.partition_key.as_deref(), Some("acct-1"));
        assert_eq!(row.trace_id.as_deref(), Some("tr-1"));
        assert_eq!(row.schema_version.as_deref(), Some("1.0.0"));
        assert_eq!(row.correlation_id.as_deref(), Some("c-1"));
        assert_eq!(row.payload, json!({"n": 1}));
        let mut want: BTreeMap<String, String> = own(&[("tenant", "acme"), ("traceparent", TP)])
            .into_iter()
            .collect();
        if redis {
            want.insert("x-extra".into(), "1".into());
        }
        assert_eq!(row.headers, Some(want), "redis {redis}");
    }
}

/// E-02: message id resolution (R137, R138, R139).
pub async fn e_02<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let body = "{\"n\": 1}";
    let cases: Vec<(Headers<'_>, bool, Result<&str, &str>)> = vec![
        (vec![("message_id", "a"), ("event_id", "b")], false, Ok("a")),
        (
            vec![("event_id", "b"), ("Nats-Msg-Id", "c")],
            false,
            Ok("b"),
        ),
        (vec![("Nats-Msg-Id", "c")], false, Ok("c")),
        (
            vec![("message_id", "   ")],
            false,
            Err("invalid message: message_id: empty"),
        ),
        (vec![], true, Err("invalid message: message_id: missing")),
    ];
    for (h, req, want) in cases {
        let got = land_msg(&c, c.msgs.nats(&h, body), req)
            .await
            .map(|r| r.message_id);
        assert_eq!(got.as_deref().map_err(String::as_str), want, "{h:?}");
    }
    // The n-th message of stream S without an id gets `S:{n}`.
    let m = c.msgs.nats(&[], body);
    let BrokerMessage::Nats { sequence, .. } = &m else {
        unreachable!()
    };
    let want = format!("S:{sequence}");
    assert_eq!(land_msg(&c, m, false).await.unwrap().message_id, want);
    let m = c.msgs.redis(&[("payload", body)]);
    let BrokerMessage::Redis { entry_id, .. } = &m else {
        unreachable!()
    };
    let want = format!("in:src:{entry_id}");
    assert_eq!(land_msg(&c, m, false).await.unwrap().message_id, want);
    e_02_rabbitmq(&c).await;
}

/// E-02's RabbitMQ rows: the message_id property, an `event_id` header before it, and no id at
/// all, which is invalid whatever require_message_id says (R137, R138, R139).
async fn e_02_rabbitmq<H: InboxHarness>(c: &Ictx<H>) {
    let body = "{\"n\": 1}";
    let m = c.msgs.rabbitmq(Some("p"), None, vec![], body);
    assert_eq!(land_msg(c, m, false).await.unwrap().message_id, "p");
    let b = vec![("event_id", AmqpValue::Text("b".into()))];
    let m = c.msgs.rabbitmq(Some("p2"), None, b, body);
    assert_eq!(land_msg(c, m, false).await.unwrap().message_id, "b");
    let m = c.msgs.rabbitmq(None, None, vec![], body);
    assert_eq!(
        land_msg(c, m, false).await.map(|r| r.message_id),
        Err("invalid message: message_id: missing".to_owned())
    );
}

/// E-03: source and event_type (R137).
pub async fn e_03<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let cases: Vec<(Headers<'_>, &str, (&str, &str))> = vec![
        (
            vec![
                ("source", "s1"),
                ("source_service", "s2"),
                ("topic", "t"),
                ("event_type", "e"),
            ],
            "{\"n\": 1}",
            ("s1", "e"),
        ),
        (
            vec![("source_service", "s2"), ("topic", "t")],
            "{\"n\": 1}",
            ("s2", "s2"),
        ),
        (
            vec![("topic", "t")],
            "{\"event_type\": \"x.y\"}",
            ("t", "x.y"),
        ),
        (vec![], "{\"event_type\": \"  \"}", ("src", "src")),
    ];
    for (i, (h, body, want)) in cases.into_iter().enumerate() {
        let mut h = h;
        let id = format!("e3-{i}");
        h.push(("event_id", &id));
        let row = land_msg(&c, c.msgs.nats(&h, body), false).await.unwrap();
        assert_eq!(
            (row.source.as_str(), row.event_type.as_str()),
            want,
            "case {i}"
        );
    }
    e_03_rabbitmq(&c).await;
}

/// E-03's RabbitMQ rows: the routing key without its prefix and the type property; with an
/// empty routing key (a fanout exchange), the queue name (R137).
async fn e_03_rabbitmq<H: InboxHarness>(c: &Ictx<H>) {
    let body = "{\"n\": 1}";
    let routed = |id: &str, kind: Option<&str>, key: &str| {
        let mut m = c.msgs.rabbitmq(Some(id), kind, vec![], body);
        if let BrokerMessage::RabbitMq { routing_key, .. } = &mut m {
            *routing_key = key.to_owned();
        }
        m
    };
    let row = land_msg(c, routed("r3-1", Some("order.paid"), "in.orders"), false)
        .await
        .unwrap();
    assert_eq!(
        (row.source.as_str(), row.event_type.as_str()),
        ("orders", "order.paid")
    );
    let row = land_msg(c, routed("r3-2", None, ""), false).await.unwrap();
    assert_eq!((row.source.as_str(), row.event_type.as_str()), ("q", "q"));
}

fn with_field<'a>(id: &'a str, field: &'a str, v: &'a str) -> Vec<(&'a str, &'a str)> {
    let mut h = vec![("topic", "src")];
    if field != "message_id" {
        h.push(("event_id", id));
    }
    if field != "event_type" {
        h.push(("event_type", "e"));
    }
    h.push((field, v));
    h
}

/// E-04: field limits (R102, R139).
pub async fn e_04<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let limits = [
        ("message_id", 255),
        ("source", 255),
        ("partition_key", 255),
        ("event_type", 100),
        ("trace_id", 64),
        ("correlation_id", 64),
        ("causation_id", 64),
        ("schema_version", 50),
    ];
    for (i, (field, max)) in limits.iter().enumerate() {
        let id = format!("e4-{i}");
        let at = "a".repeat(*max);
        let over = "a".repeat(max + 1);
        let ok = land_msg(
            &c,
            c.msgs.nats(&with_field(&id, field, &at), "{\"n\": 1}"),
            false,
        )
        .await;
        assert!(ok.is_ok(), "{field} at {max}: {ok:?}");
        let id2 = format!("e4-{i}-over");
        let bad = land_msg(
            &c,
            c.msgs.nats(&with_field(&id2, field, &over), "{\"n\": 1}"),
            false,
        )
        .await;
        assert_eq!(
            bad.unwrap_err(),
            format!("invalid message: {field}: longer than {max} characters")
        );
    }
    for (i, (field, v)) in [
        ("message_id", "a\u{0}b"),
        ("source", "s\u{0}"),
        ("partition_key", "k\u{0}"),
    ]
    .iter()
    .enumerate()
    {
        let id = format!("e4-nul-{i}");
        let bad = land_msg(
            &c,
            c.msgs.nats(&with_field(&id, field, v), "{\"n\": 1}"),
            false,
        )
        .await;
        assert_eq!(
            bad.unwrap_err(),
            format!("invalid message: {field}: contains U+0000")
        );
    }
}

/// E-05: payloads (R104, R139).
pub async fn e_05<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let big = format!("{{\"x\": \"{}\"}}", "a".repeat(999_992));
    let bigger = format!("{{\"x\": \"{}\"}}", "a".repeat(999_993));
    let cases: Vec<(String, Result<serde_json::Value, &str>)> = vec![
        (big, Ok(json!(null))),
        (bigger, Err("payload exceeds 1000000 bytes")),
        ("{ \"x\" : 1 }".into(), Ok(json!({"x": 1}))),
        ("{}".into(), Err("payload is empty")),
        ("[1, 2]".into(), Err("body is not a JSON object")),
        ("not json".into(), Err("body is not JSON")),
        ("{\"x\": 1e999}".into(), Err("body is not JSON")),
        (
            "{\"x\": \"a\\u0000b\"}".into(),
            Err("payload contains U+0000"),
        ),
        ("{\"a\\u0000\": 1}".into(), Err("payload contains U+0000")),
        (
            "{\"x\": [\"\\u0000\"]}".into(),
            Err("payload contains U+0000"),
        ),
    ];
    for (i, (body, want)) in cases.into_iter().enumerate() {
        let id = format!("e5-{i}");
        let got = land_msg(&c, c.msgs.nats(&[("event_id", &id)], &body), false).await;
        match want {
            Ok(p) => {
                let row = got.unwrap_or_else(|e| panic!("case {i}: {e}"));
                if !p.is_null() {
                    assert_eq!(row.payload, p);
                }
            }
            Err(reason) => assert_eq!(
                got.unwrap_err(),
                format!("invalid message: {reason}"),
                "case {i}"
            ),
        }
    }
    let got = land_msg(&c, c.msgs.redis(&[("event_id", "e5-r")]), false).await;
    assert_eq!(got.unwrap_err(), "invalid message: payload field missing");
}

/// E-06: headers (R6, R139, R141).
pub async fn e_06<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let user: Vec<(String, String)> = (0..100)
        .map(|i| (format!("h{i}"), "v".to_string()))
        .collect();
    let mut h: Vec<(&str, &str)> = user.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let agg = uuid::Uuid::new_v4().to_string();
    h.extend([
        ("event_id", "e6-0"),
        ("topic", "src"),
        ("event_type", "e"),
        ("aggregate_type", "o"),
        ("aggregate_id", agg.as_str()),
        ("created_at", "2026-12-01T10:15:30.123456Z"),
        ("Nats-Msg-Id", "e6-0"),
    ]);
    let row = land_msg(&c, c.msgs.nats(&h, "{\"n\": 1}"), false)
        .await
        .unwrap();
    assert_eq!(row.headers.unwrap().len(), 100);
    let many: Vec<(String, String)> = (0..101)
        .map(|i| (format!("h{i}"), "v".to_string()))
        .collect();
    let mut h: Vec<(&str, &str)> = many.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    h.push(("event_id", "e6-1"));
    assert_eq!(
        land_msg(&c, c.msgs.nats(&h, "{\"n\": 1}"), false)
            .await
            .unwrap_err(),
        "invalid message: headers: more than 100 entries"
    );
    assert!(
        land_msg(
            &c,
            c.msgs
                .nats(&[("event_id", "e6-2"), ("a", "x\ny")], "{\"n\": 1}"),
            false
        )
        .await
        .is_err()
    );
    assert!(
        land_msg(
            &c,
            c.msgs
                .nats(&[("event_id", "e6-3"), ("a", "x\ty")], "{\"n\": 1}"),
            false
        )
        .await
        .is_ok()
    );
    assert_eq!(
        land_msg(
            &c,
            c.msgs
                .nats(&[("event_id", "e6-4"), ("tenant", "a\u{0}b")], "{\"n\": 1}"),
            false
        )
        .await
        .unwrap_err(),
        "invalid message: headers: tenant contains U+0000"
    );
    assert_eq!(
        land_msg(
            &c,
            c.msgs.nats(
                &[("event_id", "e6-5"), ("tenant", "a"), ("tenant", "b")],
                "{\"n\": 1}"
            ),
            false
        )
        .await
        .unwrap_err(),
        "invalid message: headers: repeated key tenant"
    );
    assert!(
        land_msg(
            &c,
            c.msgs.nats(
                &[("event_id", "e6-6"), ("A", "1"), ("a", "2")],
                "{\"n\": 1}"
            ),
            false
        )
        .await
        .is_err()
    );
    assert_eq!(
        land_msg(
            &c,
            c.msgs.redis(&[
                ("event_id", "e6-7"),
                ("payload", "{\"n\": 1}"),
                ("headers", "[1]")
            ]),
            false
        )
        .await
        .unwrap_err(),
        "invalid message: headers: not a JSON object of strings"
    );
}

/// E-07: an invalid delivery is dead-lettered, then terminated, under every policy (R114,
/// R139, R140, R142).
pub async fn e_07<F: InboxFactory>(f: &F) {
    for redis in [false, true] {
        for policy in ["at_most_once", "record", "rewind"] {
            let c = Ictx::new(f).await;
            let m = if redis {
                c.msgs.redis(&[("payload", "not json")])
            } else {
                c.msgs.nats(&[], "not json")
            };
            let i = c.sub.push(m.clone());
            let b = c.runner();
            let b = match policy {
                "at_most_once" => b.at_most_once(true),
                "record" => b.on_failure(OnFailure::Record),
                _ => b.on_failure(OnFailure::Rewind),
            };
            let res = c.handle(&b.build().unwrap()).await;
            assert_eq!(
                (res.outcome, res.committed),
                (O::Invalid, false),
                "{policy}"
            );
            let reason = "invalid message: body is not JSON";
            assert_eq!(c.sub.acks(i), vec![AckOp::Term(reason.into())], "{policy}");
            let dl = c.sub.dead_letters();
            assert_eq!(dl.len(), 1);
            assert_eq!(
                (&dl[0].message, dl[0].reason.as_str(), dl[0].group.as_str()),
                (&m, reason, "g")
            );
            assert_eq!(c.handler.runs().len(), 0);
            assert!(c.backend().counts(&g()).await.unwrap().is_empty(), "no row");
        }
    }
}

/// E-08: a dead-letter copy that fails rewinds the delivery 1.0 s (R140).
pub async fn e_08<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let i = c.sub.push(c.msgs.nats(&[], "not json"));
    c.sub.fail_dead_letter();
    let r = c.runner().build().unwrap();
    c.handle(&r).await;
    assert_eq!(c.sub.acks(i), vec![AckOp::Rewind(Duration::from_secs(1))]);
    assert!(c.sub.dead_letters().is_empty());
    c.advance(Duration::from_secs(1)).await;
    c.handle(&r).await;
    assert_eq!(
        c.sub.acks(i)[1],
        AckOp::Term("invalid message: body is not JSON".into())
    );
    assert_eq!(c.sub.dead_letters().len(), 1);
    assert!(c.backend().counts(&g()).await.unwrap().is_empty());
}

/// E-09: stored defaults (R100, R103, R105).
pub async fn e_09<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    c.deliver("m1", None);
    let res = c.handle(&c.bare_runner().build().unwrap()).await;
    assert_eq!(res.outcome, O::Landed);
    let r = c.row_of("m1").await;
    assert_eq!(
        (r.status, r.attempts_made, r.max_attempts),
        (Status::Pending, 0, 6)
    );
    assert!(
        r.last_error.is_none()
            && r.completed_at.is_none()
            && r.locked_at.is_none()
            && r.locked_by.is_none()
            && r.idempotency_key.is_none()
    );
    assert_eq!(
        (r.scheduled_at, r.updated_at),
        (r.created_at, Some(r.created_at))
    );
    assert_eq!(r.id.get_version_num(), 7);
    assert_eq!(r.headers, None);
}

/// E-10: landing follows the caller's transaction (R107).
pub async fn e_10<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let b = c.backend();
    let e = || {
        NewInboxEvent::builder()
            .message_id("m1")
            .consumer_group("g")
            .source("src")
            .payload_json(json!({"n": 1}))
            .build()
            .unwrap()
    };
    let mut t = b.begin().await.unwrap();
    t.land(vec![e()]).await.unwrap();
    t.rollback().await;
    assert!(b.get_by_message_id("m1", &g()).await.unwrap().is_none());
    let mut u = b.begin().await.unwrap();
    let l = u.land(vec![e()]).await.unwrap();
    u.commit().await.unwrap();
    assert!(l[0].inserted);
    assert_eq!(
        b.get_by_message_id("m1", &g()).await.unwrap().map(|r| r.id),
        Some(l[0].row.id)
    );
}

/// `sha256:` + the lowercase hex SHA-256 of `bytes`, computed here independently of the adapter's
/// helper (FIPS 180-4 test vectors pin it, see the unit test of `txoutbox_core::inbox::decode`).
fn sha256_key(bytes: &[u8]) -> String {
    use sha2::Digest;
    let d = sha2::Sha256::digest(bytes);
    let hex: String = d.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// E-11: Kafka records (R137, R139, R140, R179): the record key as the inbox key, hashed when it
/// is not short text; repeated and non-UTF-8 headers; a tombstone dead-lettered.
pub async fn e_11<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let body = Some("{\"n\": 1}");
    let id = |v: &'static str| Some(v.as_bytes());
    let pk =
        |headers: &[(&str, Option<&[u8]>)], key: Option<&[u8]>| c.msgs.kafka(0, headers, key, body);
    let cases: Vec<(BrokerMessage, Result<Option<String>, &str>)> = vec![
        (
            pk(&[("event_id", id("k1"))], Some(b"acct-1")),
            Ok(Some("acct-1".into())),
        ),
        (
            pk(
                &[("event_id", id("k2")), ("partition_key", id("p"))],
                Some(b"acct-1"),
            ),
            Ok(Some("p".into())),
        ),
        (
            pk(&[("event_id", id("k3"))], Some("a".repeat(300).as_bytes())),
            Ok(Some(sha256_key("a".repeat(300).as_bytes()))),
        ),
        (
            pk(&[("event_id", id("k4"))], Some(&[0xff, 0x00])),
            Ok(Some(sha256_key(&[0xff, 0x00]))),
        ),
        (
            pk(&[("event_id", id("k5"))], Some(&[0, 0, 0, 0x2a])),
            Ok(Some(sha256_key(&[0, 0, 0, 0x2a]))),
        ),
        (
            pk(&[("message_id", Some(b"a\0b"))], Some(b"acct-1")),
            Err("invalid message: message_id: contains U+0000"),
        ),
        (pk(&[("event_id", id("k6"))], Some(b"")), Ok(None)),
        (pk(&[("event_id", id("k7"))], None), Ok(None)),
        (
            pk(
                &[
                    ("event_id", id("k8")),
                    ("tenant", id("a")),
                    ("tenant", id("b")),
                ],
                None,
            ),
            Err("invalid message: headers: repeated key tenant"),
        ),
    ];
    for (m, want) in cases {
        let got = land_msg(&c, m.clone(), false)
            .await
            .map(|r| r.partition_key);
        assert_eq!(
            got.as_ref().map_err(String::as_str),
            want.as_ref().map_err(|e| *e),
            "{m:?}"
        );
    }
    // Values that are not UTF-8, and null values, are neither read nor stored.
    let row = land_msg(
        &c,
        pk(
            &[
                ("event_id", id("k9")),
                ("x-bin", Some(&[0xff, 0xfe])),
                ("x-null", None),
                ("tenant", id("acme")),
            ],
            None,
        ),
        false,
    )
    .await
    .expect("landed");
    assert_eq!(
        row.headers,
        Some(own(&[("tenant", "acme")]).into_iter().collect())
    );
    // A tombstone: invalid, dead-lettered as received, then terminated.
    let tomb = c.msgs.kafka(0, &[("event_id", id("t1"))], Some(b"k"), None);
    let before = c.sub.dead_letters().len();
    let i = c.sub.push(tomb.clone());
    let res = c.handle(&c.runner().build().unwrap()).await;
    assert_eq!(res.outcome, O::Invalid);
    let reason = "invalid message: record has no value";
    assert_eq!(res.error.as_deref(), Some(reason));
    assert_eq!(c.sub.acks(i), vec![AckOp::Term(reason.into())]);
    let dl = c.sub.dead_letters();
    assert_eq!(dl.len(), before + 1, "one copy, of the tombstone");
    assert_eq!(
        (
            &dl[before].message,
            dl[before].reason.as_str(),
            dl[before].group.as_str()
        ),
        (&tomb, reason, "g")
    );
    assert!(
        c.backend()
            .get_by_message_id("t1", &g())
            .await
            .unwrap()
            .is_none()
    );
}

/// E-12: RabbitMQ header values: strings as they are, integers and booleans as their text,
/// tables, timestamps and RabbitMQ's own headers not stored, and only string values read
/// (R137, R141).
pub async fn e_12<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let body = "{\"n\": 1}";
    let stored = |row: &InboxEvent| row.headers.clone().unwrap_or_default();
    let want = |h: &[(&str, &str)]| -> BTreeMap<String, String> { own(h).into_iter().collect() };
    let m = c.msgs.rabbitmq(
        Some("r1"),
        None,
        vec![
            ("retries", AmqpValue::Integer(3)),
            ("flag", AmqpValue::Boolean(true)),
        ],
        body,
    );
    let row = land_msg(&c, m, false).await.expect("landed");
    assert_eq!(stored(&row), want(&[("retries", "3"), ("flag", "true")]));
    let m = c.msgs.rabbitmq(
        Some("r2"),
        None,
        vec![
            ("nested", AmqpValue::Other("table".into())),
            ("when", AmqpValue::Other("timestamp".into())),
        ],
        body,
    );
    let row = land_msg(&c, m, false).await.expect("landed");
    assert_eq!(stored(&row), want(&[]));
    let m = c.msgs.rabbitmq(
        Some("r3"),
        None,
        vec![
            ("x-death", AmqpValue::Other("array".into())),
            ("x-delivery-count", AmqpValue::Integer(2)),
            ("x-first-death-queue", AmqpValue::Text("q0".into())),
        ],
        body,
    );
    let row = land_msg(&c, m, false).await.expect("landed");
    assert_eq!(stored(&row), want(&[]));
    let m = c.msgs.rabbitmq(
        Some("p"),
        None,
        vec![("event_id", AmqpValue::Integer(5))],
        body,
    );
    let row = land_msg(&c, m, false).await.expect("landed");
    assert_eq!(row.message_id, "p", "only string values are read");
    assert_eq!(stored(&row), want(&[]), "event_id is a name R137 reads");
}

/// E-13: CloudEvents attribute headers are read where R137 puts them and never stored: Kafka's
/// `ce_` headers (and `content-type` only with `ce_specversion`), NATS names in any case with
/// values percent-decoded, RabbitMQ under either separator of the AMQP binding; a NATS value that
/// is not percent-encoded UTF-8 is invalid (R137, R139, R141, R180).
pub async fn e_13<F: InboxFactory>(f: &F) {
    e_13_kafka(f).await;
    let c = Ictx::new(f).await;
    let m = c.msgs.nats(
        &[
            ("CE-SpecVersion", "1.0"),
            ("ce-id", "c1"),
            ("ce-type", "order%20paid"),
            ("tenant", "acme"),
        ],
        "{\"n\": 1}",
    );
    let row = land_msg(&c, m, false).await.expect("landed");
    assert_eq!(
        (row.message_id.as_str(), row.event_type.as_str()),
        ("c1", "order paid")
    );
    assert_eq!(
        row.headers,
        Some(own(&[("tenant", "acme")]).into_iter().collect()),
        "no ce- header stored"
    );
    let m = c
        .msgs
        .nats(&[("event_id", "n2"), ("ce-type", "%C0%A0")], "{\"n\": 1}");
    assert_eq!(
        land_msg(&c, m, false).await.map(|r| r.message_id),
        Err("invalid message: headers: ce-type is not percent-encoded UTF-8".to_owned())
    );
    for sep in [":", "_"] {
        let (spec, id) = (
            format!("cloudEvents{sep}specversion"),
            format!("cloudEvents{sep}id"),
        );
        let m = c.msgs.rabbitmq(
            None,
            None,
            vec![
                (spec.as_str(), AmqpValue::Text("1.0".into())),
                (id.as_str(), AmqpValue::Text(format!("c1{sep}"))),
            ],
            "{\"n\": 1}",
        );
        let row = land_msg(&c, m, false).await.expect("landed");
        assert_eq!(row.message_id, format!("c1{sep}"));
        assert_eq!(row.headers.unwrap_or_default(), BTreeMap::new(), "{sep}");
    }
}

/// E-13's Kafka rows, on a table of their own (their message ids repeat the NATS row's).
async fn e_13_kafka<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let body = Some("{\"n\": 1}");
    let v = |s: &'static str| Some(s.as_bytes());
    let stored = |row: &InboxEvent| row.headers.clone().unwrap_or_default();
    let want = |h: &[(&str, &str)]| -> BTreeMap<String, String> { own(h).into_iter().collect() };
    let m = c.msgs.kafka(
        0,
        &[
            ("ce_specversion", v("1.0")),
            ("ce_id", v("c1")),
            ("ce_type", v("t.x")),
            ("ce_source", v("/s")),
            ("ce_time", v("2026-12-01T10:15:30Z")),
            ("ce_partitionkey", v("k9")),
            ("content-type", v("application/json")),
            ("tenant", v("acme")),
        ],
        Some(b"rk"),
        body,
    );
    let row = land_msg(&c, m, false).await.expect("landed");
    assert_eq!(
        (
            row.message_id.as_str(),
            row.event_type.as_str(),
            row.partition_key.as_deref()
        ),
        ("c1", "t.x", Some("k9"))
    );
    assert_eq!(
        stored(&row),
        want(&[("tenant", "acme")]),
        "no ce_ header and no content-type stored in CloudEvents mode"
    );
    let m = c
        .msgs
        .kafka(0, &[("event_id", v("e1")), ("ce_id", v("c1"))], None, body);
    let row = land_msg(&c, m, false).await.expect("landed");
    assert_eq!(row.message_id, "e1", "event_id comes before ce_id");
    let m = c
        .msgs
        .kafka(0, &[("content-type", v("application/json"))], None, body);
    let row = land_msg(&c, m, false).await.expect("landed");
    assert_eq!(
        stored(&row),
        want(&[("content-type", "application/json")]),
        "without ce_specversion, content-type is an ordinary header"
    );
}

/// E-17: a payload holding U+0000, in a string or in a key, is invalid under R139's metric label
/// `nul`, while a field of R102 holding it keeps the label `field` (R104, R139).
pub async fn e_17<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let cases = [
        (
            c.msgs
                .nats(&[("event_id", "e17-1")], "{\"x\": \"a\\u0000b\"}"),
            "payload contains U+0000",
            "nul",
        ),
        (
            c.msgs.nats(&[("event_id", "e17-2")], "{\"a\\u0000\": 1}"),
            "payload contains U+0000",
            "nul",
        ),
        (
            c.msgs.nats(
                &[("event_id", "e17-3"), ("partition_key", "a\0b")],
                "{\"n\": 1}",
            ),
            "partition_key: contains U+0000",
            "field",
        ),
    ];
    for (m, reason, label) in cases {
        c.sub.push(m);
        let res = c.handle(&c.bare_runner().build().unwrap()).await;
        assert_eq!(
            (res.outcome, res.error.as_deref(), res.invalid_label),
            (
                O::Invalid,
                Some(format!("invalid message: {reason}").as_str()),
                Some(label)
            ),
            "{res:?}"
        );
    }
}

/// E-15: the trace-context header is read whatever the case of its name (Go's canonical
/// `Traceparent`, `TRACEPARENT`), on NATS, Redis and Kafka: a valid value and an invalid one both
/// land, stored as `traceparent`, since a bad trace context never makes a delivery invalid (R141,
/// R170).
pub async fn e_15<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let body = "{\"n\": 1}";
    let mut n = 0;
    for name in ["Traceparent", "TRACEPARENT", "traceparent"] {
        for value in [TP, "00-not-a-trace-context"] {
            let msgs = [
                c.msgs
                    .nats(&[("event_id", &format!("e15-{n}")), (name, value)], body),
                c.msgs.redis(&[
                    ("event_id", &format!("e15-{}", n + 1)),
                    ("payload", body),
                    (name, value),
                ]),
                c.msgs.kafka(
                    0,
                    &[
                        ("event_id", Some(format!("e15-{}", n + 2).as_bytes())),
                        (name, Some(value.as_bytes())),
                    ],
                    None,
                    Some(body),
                ),
            ];
            n += 3;
            for m in msgs {
                let row = land_msg(&c, m.clone(), false)
                    .await
                    .unwrap_or_else(|e| panic!("{name}: {value}: {e} ({m:?})"));
                assert_eq!(
                    row.headers,
                    Some(own(&[("traceparent", value)]).into_iter().collect()),
                    "{name}: {value}"
                );
                assert_eq!(row.traceparent(), Some(value));
            }
        }
    }
}

/// E-16: a NATS header that R137 reads (`event_id`, `partition_key`, …), repeated, makes the
/// delivery invalid with `headers: repeated key {name}` and the label `headers`, as the same
/// Kafka record is (E-11), instead of landing with its first value (R139, R179).
pub async fn e_16<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let body = "{\"n\": 1}";
    for (i, name) in [
        "event_id",
        "message_id",
        "partition_key",
        "event_type",
        "trace_id",
    ]
    .into_iter()
    .enumerate()
    {
        let id = format!("e16-{i}");
        let mut h: Vec<(&str, &str)> = Vec::new();
        if name != "event_id" {
            h.push(("event_id", &id));
        }
        h.extend([(name, "a"), (name, "b")]);
        let kafka_h: Vec<(&str, Option<&[u8]>)> =
            h.iter().map(|(k, v)| (*k, Some(v.as_bytes()))).collect();
        for m in [
            c.msgs.nats(&h, body),
            c.msgs.kafka(0, &kafka_h, None, Some(body)),
        ] {
            c.sub.push(m.clone());
            let res = c.handle(&c.bare_runner().build().unwrap()).await;
            let want = format!("invalid message: headers: repeated key {name}");
            assert_eq!(
                (res.outcome, res.error.as_deref(), res.invalid_label),
                (O::Invalid, Some(want.as_str()), Some("headers")),
                "{m:?}"
            );
        }
    }
    assert_eq!(
        c.count_rows(&["a", "e16-0", "e16-1", "e16-2", "e16-3", "e16-4"])
            .await,
        0
    );
}
