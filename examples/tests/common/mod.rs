//! Fixtures for the tests that drive the `outbox-relay` binary: a fresh schema per test, a
//! writer, a fresh JetStream stream per test, and the binary as a child process.
#![allow(dead_code)]

use std::collections::HashMap;
use std::process::Stdio;
use std::time::Duration;

use rand::RngExt;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::process::{Child, Command};
use txoutbox_core::NewEvent;
use txoutbox_postgres::{PgOutboxWriter, TableName};
use uuid::Uuid;

pub const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");

pub fn database_url() -> String {
    std::env::var("OUTBOX_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

pub fn nats_url() -> String {
    std::env::var("OUTBOX_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// A random lowercase suffix.
pub fn suffix() -> String {
    let mut r = rand::rng();
    (0..10)
        .map(|_| (b'a' + r.random_range(0..26u8)) as char)
        .collect()
}

/// A fresh schema (dropped when the test ends without panicking is not needed: each test has
/// its own name) and the table name `schema.outbox_events` in it. The table is not created.
pub struct Db {
    pub pool: PgPool,
    pub schema: String,
    pub table: TableName,
}

impl Db {
    pub async fn fresh() -> Self {
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .connect(&database_url())
            .await
            .expect("PostgreSQL must be reachable at OUTBOX_TEST_DATABASE_URL (default postgres://postgres@127.0.0.1:5432/test)");
        let schema = format!("relay_t_{}", suffix());
        let table = TableName::new(&format!("{schema}.outbox_events")).expect("table");
        Self {
            pool,
            schema,
            table,
        }
    }

    pub fn table_arg(&self) -> String {
        self.table.dotted()
    }

    /// Runs `outbox-relay migrate` and checks it succeeded.
    pub async fn migrate(&self) {
        let out = relay(&["migrate", "--table", &self.table_arg()]).await;
        assert_eq!(out.code, 0, "migrate failed: {}", out.stderr);
    }

    /// Writes `per_key` events on each of `keys` keys, in transactions of `per_tx` events that
    /// interleave keys; returns per key the ids in write order. Each transaction notifies.
    pub async fn write_events(
        &self,
        topic: &str,
        keys: usize,
        per_key: usize,
        per_tx: usize,
    ) -> HashMap<String, Vec<Uuid>> {
        let writer = PgOutboxWriter::new(&self.table).notify(true);
        let mut order: HashMap<String, Vec<Uuid>> = HashMap::new();
        let mut all = Vec::new();
        for i in 0..per_key {
            for k in 0..keys {
                let key = format!("key-{k}");
                let e = NewEvent::builder()
                    .event_type("test.event")
                    .aggregate("thing", Uuid::new_v4())
                    .topic(topic)
                    .partition_key(key.clone())
                    .payload_json(serde_json::json!({ "key": key, "n": i }))
                    .build()
                    .expect("event");
                order.entry(key).or_default().push(e.id());
                all.push(e);
            }
        }
        let mut it = all.into_iter().peekable();
        while it.peek().is_some() {
            let chunk: Vec<NewEvent> = it.by_ref().take(per_tx).collect();
            let mut tx = self.pool.begin().await.expect("begin");
            writer.write(&mut tx, chunk).await.expect("write");
            tx.commit().await.expect("commit");
        }
        order
    }

    pub async fn scalar_i64(&self, sql: &str) -> i64 {
        let sql = sql.replace("{t}", &self.table.qualified());
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .fetch_one(&self.pool)
            .await
            .expect("query")
    }

    pub async fn exec(&self, sql: &str) -> u64 {
        let sql = sql.replace("{t}", &self.table.qualified());
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&self.pool)
            .await
            .expect("exec")
            .rows_affected()
    }

    /// A digest of every row, to show that a command changed nothing.
    pub async fn digest(&self) -> String {
        let sql = format!(
            "SELECT coalesce(md5(string_agg(t::text, '|' ORDER BY id)), '') FROM {} t",
            self.table.qualified()
        );
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .fetch_one(&self.pool)
            .await
            .expect("digest")
    }

    pub async fn drop_schema(&self) {
        let sql = format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", self.schema);
        let _ = sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&self.pool)
            .await;
    }
}

/// The result of one run of the binary.
#[derive(Debug)]
pub struct Out {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// Runs the binary with `args` (the database URL comes from DATABASE_URL) and waits at most 60 s.
pub async fn relay(args: &[&str]) -> Out {
    let child = command(args).spawn().expect("spawn outbox-relay");
    wait(child, Duration::from_secs(60)).await
}

/// `OUTBOX_TEST_THROUGH_POOLER=1` (OP-08): every command but `migrate` runs through the
/// transaction-pooling proxy at `OUTBOX_TEST_POOLER_URL` (default PgBouncer on 127.0.0.1:6432,
/// `scripts/pgbouncer start`) with `--pooler transaction` (`OUTBOX_POOLER`) and a direct
/// `--listen-url`; `migrate` needs the direct URL (R194) and keeps it.
pub fn through_pooler() -> bool {
    std::env::var("OUTBOX_TEST_THROUGH_POOLER").is_ok_and(|v| v == "1")
}

/// The URL of the transaction-pooling proxy (see [`through_pooler`]).
pub fn pooler_url() -> String {
    std::env::var("OUTBOX_TEST_POOLER_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:6432/test".into())
}

pub fn command(args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    let migrate = args.contains(&"migrate");
    if through_pooler() && !migrate {
        c.env("DATABASE_URL", pooler_url())
            .env("OUTBOX_POOLER", "transaction")
            .env("OUTBOX_LISTEN_URL", database_url());
    } else {
        c.env("DATABASE_URL", database_url())
            .env_remove("OUTBOX_POOLER")
            .env_remove("OUTBOX_LISTEN_URL");
    }
    c.args(args)
        .env("RUST_LOG", "info")
        .env_remove("OUTBOX_TABLE")
        .env_remove("OUTBOX_BROKER")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    c
}

pub async fn wait(child: Child, within: Duration) -> Out {
    let out = tokio::time::timeout(within, child.wait_with_output())
        .await
        .expect("outbox-relay did not exit in time")
        .expect("wait");
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A fresh JetStream stream name and subject prefix for one test.
pub struct Stream {
    pub name: String,
    pub prefix: String,
    pub js: async_nats::jetstream::Context,
}

impl Stream {
    pub async fn fresh() -> Self {
        let client = async_nats::connect(nats_url()).await.expect(
            "NATS with JetStream must be reachable at OUTBOX_TEST_NATS_URL (default nats://127.0.0.1:4222)",
        );
        let s = suffix();
        Self {
            name: format!("RELAYT_{}", s.to_uppercase()),
            prefix: format!("relayt.{s}."),
            js: async_nats::jetstream::new(client),
        }
    }

    /// Creates the stream with this duplicate window (the binary leaves an existing stream as
    /// it is).
    pub async fn create(&self, duplicate_window: Duration) {
        self.js
            .create_stream(async_nats::jetstream::stream::Config {
                name: self.name.clone(),
                subjects: vec![format!("{}>", self.prefix)],
                duplicate_window,
                storage: async_nats::jetstream::stream::StorageType::Memory,
                ..Default::default()
            })
            .await
            .expect("create stream");
    }

    /// Broker flags for the binary.
    pub fn args(&self) -> Vec<String> {
        vec![
            "--broker".into(),
            "nats".into(),
            "--nats-url".into(),
            nats_url(),
            "--nats-stream".into(),
            self.name.clone(),
            "--nats-subject-prefix".into(),
            self.prefix.clone(),
        ]
    }

    pub async fn count(&self) -> u64 {
        match self.js.get_stream(&self.name).await {
            Ok(mut s) => s.info().await.expect("stream info").state.messages,
            Err(_) => 0,
        }
    }

    /// Every message in stream order: (event id, partition key).
    pub async fn messages(&self) -> Vec<(Uuid, String)> {
        let mut s = self.js.get_stream(&self.name).await.expect("stream");
        let last = s.info().await.expect("info").state.last_sequence;
        let mut v = Vec::new();
        for seq in 1..=last {
            let m = s.get_raw_message(seq).await.expect("message");
            let h = |k: &str| {
                m.headers
                    .get(k)
                    .unwrap_or_else(|| panic!("header {k}"))
                    .as_str()
                    .to_owned()
            };
            v.push((h("event_id").parse().expect("uuid"), h("partition_key")));
        }
        v
    }

    pub async fn delete(&self) {
        let _ = self.js.delete_stream(&self.name).await;
    }
}

/// Checks that every written event arrived and that, per key, the order of first arrival is the
/// write order. Returns the number of messages that were repeats of an earlier one.
pub fn check_order(written: &HashMap<String, Vec<Uuid>>, got: &[(Uuid, String)]) -> usize {
    let first = txoutbox_conformance::broker::FirstDeliveries::of(
        got.iter().map(|(id, key)| (key.clone(), *id)),
    );
    for (key, ids) in written {
        let arrived = first.per_key.get(key).cloned().unwrap_or_default();
        assert_eq!(
            arrived.len(),
            ids.len(),
            "key {key}: {} of {} events arrived",
            arrived.len(),
            ids.len()
        );
        assert_eq!(
            &arrived, ids,
            "key {key}: order of first arrival differs from write order"
        );
    }
    assert_eq!(
        first.distinct,
        written.values().map(Vec::len).sum::<usize>(),
        "events that were not written arrived"
    );
    first.repeated
}

/// Reads the child's stderr lines into a channel as they come.
pub fn stderr_lines(
    child: &mut tokio::process::Child,
) -> tokio::sync::mpsc::UnboundedReceiver<String> {
    use tokio::io::AsyncBufReadExt;
    let err = child.stderr.take().expect("stderr piped");
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut lines = tokio::io::BufReader::new(err).lines();
        while let Ok(Some(l)) = lines.next_line().await {
            if tx.send(l).is_err() {
                return;
            }
        }
    });
    rx
}
