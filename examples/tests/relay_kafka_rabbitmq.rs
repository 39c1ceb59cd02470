//! `outbox-relay run --broker kafka|rabbitmq` (features `kafka`, `rabbitmq`): the flags, the
//! checks made before anything connects, secrets kept out of the output, and a drain through
//! RabbitMQ read back with a plain client.

mod common;

use std::time::Duration;

use common::{Db, check_order, command, relay, wait};

fn run(db: &Db, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = ["run", "--table", &db.table_arg(), "--summary-interval", "0"]
        .map(String::from)
        .to_vec();
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// Settings that can never work are refused (exit 2) before anything connects, and no row
/// changes: a publish timeout not above the adapter's bound, an unknown message format, a
/// CloudEvents format without a source, CloudEvents on a broker without a binding, an unknown
/// idempotence.
#[cfg(all(feature = "kafka", feature = "rabbitmq"))]
#[tokio::test(flavor = "multi_thread")]
async fn impossible_settings_are_refused_before_connecting() {
    let db = Db::fresh().await;
    db.migrate().await;
    db.write_events("kr", 1, 2, 10).await;
    let cases: [(&[&str], &str); 6] = [
        (
            &[
                "--broker",
                "kafka",
                "--publish-timeout",
                "5s",
                "--broker-timeout",
                "10s",
            ],
            "must exceed --broker-timeout",
        ),
        (
            &[
                "--broker",
                "rabbitmq",
                "--publish-timeout",
                "10s",
                "--broker-timeout",
                "10s",
            ],
            "must exceed --broker-timeout",
        ),
        (
            &["--broker", "kafka", "--message-format", "structured"],
            "--message-format",
        ),
        (
            &["--broker", "rabbitmq", "--message-format", "cloudevents"],
            "cloudevents_source",
        ),
        (
            &["--broker", "nats", "--message-format", "cloudevents"],
            "kafka and rabbitmq only",
        ),
        (
            &["--broker", "kafka", "--kafka-idempotence", "auto"],
            "--kafka-idempotence",
        ),
    ];
    for (extra, needle) in cases {
        let out = relay(&strs(&run(&db, extra))).await;
        assert_eq!(out.code, 2, "{extra:?}: {}", out.stderr);
        assert!(out.stderr.contains(needle), "{extra:?}: {}", out.stderr);
    }
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM {t} WHERE status = 'pending' AND attempts_made = 0")
            .await,
        2,
        "no row may change"
    );
    db.drop_schema().await;
}

/// While the broker is unreachable the relay waits for it and logs where it waits, with the
/// password of AMQP_URL (and the SASL password) replaced by `***`.
#[cfg(all(feature = "kafka", feature = "rabbitmq"))]
#[tokio::test(flavor = "multi_thread")]
async fn waiting_for_an_unreachable_broker_prints_no_secret() {
    let db = Db::fresh().await;
    db.migrate().await;
    let port = txoutbox_conformance::broker::closed_port().await;
    for (broker, env) in [
        (
            "rabbitmq",
            ("AMQP_URL", format!("amqp://app:amqp-s3cret@{port}/%2f")),
        ),
        ("kafka", ("KAFKA_BROKERS", port.to_string())),
    ] {
        let mut c = command(&strs(&run(
            &db,
            &["--broker", broker, "--broker-timeout", "1s"],
        )));
        c.env(env.0, &env.1)
            .env("OUTBOX_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512")
            .env("OUTBOX_KAFKA_SASL_USERNAME", "app")
            .env("KAFKA_SASL_PASSWORD", "sasl-s3cret");
        let mut child = c.spawn().expect("spawn");
        tokio::time::sleep(Duration::from_secs(4)).await;
        child.start_kill().expect("kill");
        let out = wait(child, Duration::from_secs(30)).await;
        assert!(
            out.stderr.contains("waiting for the broker"),
            "{broker}: {}",
            out.stderr
        );
        assert!(!out.stderr.contains("s3cret"), "{broker}: {}", out.stderr);
        if broker == "rabbitmq" {
            assert!(out.stderr.contains("app:***@"), "{}", out.stderr);
        }
    }
    db.drop_schema().await;
}

/// A drain through RabbitMQ: every event lands once in the bound queue, per key in write order,
/// read back with basic.get.
#[cfg(feature = "rabbitmq")]
#[tokio::test(flavor = "multi_thread")]
async fn rabbitmq_queue_holds_every_event_once_in_key_order() {
    use txoutbox_rabbitmq_broker::lapin::options::{
        BasicGetOptions, QueueDeclareOptions, QueueDeleteOptions,
    };
    use txoutbox_rabbitmq_broker::lapin::types::FieldTable;
    use txoutbox_rabbitmq_broker::lapin::{Connection, ConnectionProperties};
    use uuid::Uuid;

    let db = Db::fresh().await;
    db.migrate().await;
    let url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let prefix = format!("relayt.{}.", common::suffix());
    let topic = "flags";
    let queue = format!("{prefix}{topic}");
    let conn = Connection::connect(&url, ConnectionProperties::default())
        .await
        .expect("RabbitMQ must be reachable at AMQP_URL");
    let ch = conn.create_channel().await.expect("channel");
    ch.queue_declare(
        queue.as_str().into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("declare");
    let written = db.write_events(topic, 10, 8, 25).await;
    let n: usize = written.values().map(Vec::len).sum();
    let out = wait(
        command(&strs(&run(
            &db,
            &[
                "--broker",
                "rabbitmq",
                "--amqp-url",
                &url,
                "--rabbitmq-routing-key-prefix",
                &prefix,
                "--publish-concurrency",
                "4",
                "--until-drained",
            ],
        )))
        .spawn()
        .expect("spawn"),
        Duration::from_secs(120),
    )
    .await;
    let mut got: Vec<(Uuid, String)> = Vec::new();
    while let Some(m) = ch
        .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .expect("basic.get")
    {
        let p = &m.delivery.properties;
        let id: Uuid = p
            .message_id()
            .as_ref()
            .expect("message_id")
            .as_str()
            .parse()
            .expect("uuid");
        let key = p
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get("partition_key").cloned())
            .and_then(|v| v.as_long_string().map(|s| s.to_string()))
            .expect("partition_key header");
        got.push((id, key));
    }
    let _ = ch
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await;
    assert_eq!(out.code, 0, "run --broker rabbitmq: {}", out.stderr);
    assert_eq!(check_order(&written, &got), 0, "an event was added twice");
    assert_eq!(got.len(), n, "every event arrived");
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM {t} WHERE status = 'completed'")
            .await,
        n as i64
    );
    db.drop_schema().await;
}
