//! The unit tests of the SQL home.

use super::*;

/// Every rendered statement is complete: no `{placeholder}` left, no comment line, the
/// table quoted, and every `$n` it uses numbered from 1 without a gap.
#[test]
fn statement_files_render_completely() {
    let t = TableName::new("ops.outbox_events").unwrap();
    let s = Statements::new(&t);
    #[allow(unused_mut)]
    let mut all = vec![
        ("fetch_heads", &s.fetch_heads),
        ("fetch_heads_autocommit", &s.fetch_heads_autocommit),
        ("fetch_take", &s.fetch_take),
        ("fetch_take_transaction", &s.fetch_take_transaction),
        ("get", &s.get),
        ("complete", &s.complete),
        ("fail", &s.fail),
        ("complete_in_delivery", &s.complete_in_delivery),
        ("fail_in_delivery", &s.fail_in_delivery),
        ("release", &s.release),
        ("refresh_lock", &s.refresh_lock),
        ("release_lock", &s.release_lock),
        ("release_locks", &s.release_locks),
        ("release_stale", &s.release_stale),
        ("requeue", &s.requeue),
        ("delete_old_completed", &s.delete_old_completed),
        ("force_unlock", &s.force_unlock),
        ("blocked_keys", &s.blocked_keys),
        ("counts", &s.counts),
        ("oldest_due_age", &s.oldest_due_age),
        ("drained", &s.drained),
        ("failed_ids", &s.failed_ids),
        ("parked_rows", &s.parked_rows),
        ("redrive", &s.redrive),
        ("discard", &s.discard),
    ];
    #[cfg(feature = "test-hooks")]
    all.push(("shift_clock", &s.shift_clock));
    for &(name, text) in &all {
        assert!(!text.contains('{') && !text.contains('}'), "{name}: {text}");
        assert!(!text.contains("--"), "{name} keeps a comment");
        assert!(text.contains("\"ops\".\"outbox_events\""), "{name}: {text}");
        let mut used: Vec<u32> = text
            .split('$')
            .skip(1)
            .filter_map(|p| {
                let d: String = p.chars().take_while(char::is_ascii_digit).collect();
                d.parse().ok()
            })
            .collect();
        used.sort_unstable();
        used.dedup();
        assert!(
            used.iter().enumerate().all(|(i, n)| *n == i as u32 + 1),
            "{name} parameters {used:?}"
        );
    }
    let want: Vec<(&str, usize)> = vec![
        ("fetch_heads", 9),
        ("fetch_heads_autocommit", 9),
        ("fetch_take", 8),
        ("fetch_take_transaction", 9),
        ("blocked_keys", 4),
    ];
    for (name, n) in want {
        let text = all.iter().find(|(k, _)| *k == name).unwrap().1;
        assert!(text.contains(&format!("${n}")) && !text.contains(&format!("${}", n + 1)));
    }
}

/// The two renderings of the heads statement differ only by the clause that makes the
/// autocommit one's own transaction commit without waiting for the WAL flush.
#[test]
fn the_autocommit_heads_statement_only_adds_its_commit_setting() {
    let s = Statements::new(&TableName::new("outbox_events").unwrap());
    let clause = "WHERE (SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL";
    assert!(!s.fetch_heads.contains("synchronous_commit"));
    assert_eq!(s.fetch_heads_autocommit.matches(clause).count(), 1);
    assert_eq!(
        s.fetch_heads_autocommit.replace(clause, ""),
        s.fetch_heads,
        "the same statement otherwise"
    );
}

#[test]
fn table_names_follow_r78() {
    assert!(TableName::new("outbox_events").is_ok());
    assert!(TableName::new("ops.outbox_events").is_ok());
    assert!(TableName::new("Outbox").is_err());
    assert!(TableName::new("a-b").is_err());
    assert!(TableName::new(&"a".repeat(31)).is_ok());
    assert!(TableName::new(&"a".repeat(32)).is_err());
    assert!(TableName::new(&format!("{}.t", "s".repeat(63))).is_ok());
    assert!(TableName::new(&format!("{}.t", "s".repeat(64))).is_err());
    assert!(TableName::new("a.b.c").is_err());
    assert!(TableName::new("").is_err());
    assert!(TableName::new("1abc").is_err());
    assert!(TableName::new("x\"; drop table y; --").is_err());
    let t = TableName::new(&"a".repeat(31)).unwrap();
    for ix in indexes(&t) {
        assert!(ix.name.len() <= 63, "{}", ix.name);
    }
    assert!(format!("ck_{}_completed_status_consistency", t.table()).len() <= 63);
}

#[test]
fn notify_channels_fit_postgres_limit_and_differ_per_table() {
    let short = TableName::new("s1.outbox_events").unwrap();
    assert_eq!(short.notify_channel(), "outbox.s1.outbox_events");
    let long = TableName::new(&format!("{}.{}", "s".repeat(63), "t".repeat(31))).unwrap();
    let c = long.notify_channel();
    assert!(c.len() <= 63, "{c}");
    assert_eq!(c, long.notify_channel());
    let other = TableName::new(&format!("{}.{}", "s".repeat(63), "u".repeat(31))).unwrap();
    assert_ne!(c, other.notify_channel());
}

#[test]
fn ddl_names_derive_from_the_table() {
    let t = TableName::new("ops.my_outbox").unwrap();
    let ddl = ddl(&t).join(";\n");
    assert!(ddl.contains("CREATE SCHEMA IF NOT EXISTS \"ops\""));
    assert!(ddl.contains("\"ck_my_outbox_lock_consistency\""));
    assert!(ddl.contains("\"idx_my_outbox_pending_key_order\" ON \"ops\".\"my_outbox\""));
    assert!(!ddl.contains("outbox_events"));
    assert_eq!(ancestor_ddl(&t).len(), 8);
}

#[test]
fn headers_decode_only_as_string_maps() {
    assert_eq!(decode_headers(None), Ok(None));
    assert_eq!(decode_headers(Some(serde_json::json!({}))), Ok(None));
    assert_eq!(
        decode_headers(Some(serde_json::json!({"a": "b"})))
            .unwrap()
            .unwrap()["a"],
        "b"
    );
    assert!(decode_headers(Some(serde_json::json!({"a": 1}))).is_err());
    assert!(decode_headers(Some(serde_json::json!(["a"]))).is_err());
}

#[test]
fn sqlstates_classify() {
    assert_eq!(classify("08006"), ErrorClass::Transient);
    assert_eq!(classify("57P01"), ErrorClass::Transient);
    assert_eq!(classify("23505"), ErrorClass::Constraint);
    assert_eq!(classify("42P01"), ErrorClass::Schema);
    assert_eq!(classify("22001"), ErrorClass::Other);
}

#[test]
fn sqlstates_refusing_a_message() {
    for code in ["22001", "22P02", "22P05", "23505", "23514"] {
        assert!(refuses_message(code), "{code}");
    }
    for code in ["08006", "40001", "42P01", "XX000"] {
        assert!(!refuses_message(code), "{code}");
    }
}

#[test]
fn data_exceptions_by_message() {
    // PostgreSQL 15's own messages for each, as psql shows them with VERBOSITY verbose.
    for (message, code) in [
        (
            "invalid input syntax for type numeric: \"m1\"",
            Some("22P02"),
        ),
        ("invalid input syntax for type json", Some("22P02")),
        ("invalid input syntax for type uuid: \"x\"", Some("22P02")),
        (
            "invalid input syntax for type timestamp with time zone: \"x\"",
            Some("22007"),
        ),
        (
            "value too long for type character varying(2)",
            Some("22001"),
        ),
        ("numeric field overflow", Some("22003")),
        ("integer out of range", Some("22003")),
        ("smallint out of range", Some("22003")),
        ("value out of range: overflow", Some("22003")),
        (
            "\"1e400\" is out of range for type double precision",
            Some("22003"),
        ),
        (
            "date/time field value out of range: \"2020-13-45\"",
            Some("22008"),
        ),
        ("timestamp out of range: \"300000-01-01\"", Some("22008")),
        ("division by zero", Some("22012")),
        (
            "invalid byte sequence for encoding \"UTF8\": 0xff",
            Some("22021"),
        ),
        ("unsupported Unicode escape sequence", Some("22P05")),
        ("deadlock detected", None),
        ("relation \"x.inbox\" does not exist", None),
        ("my trigger refuses this", None),
    ] {
        assert_eq!(data_exception_from_message(message), code, "{message}");
    }
}
