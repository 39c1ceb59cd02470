//! OP-13 on the sqlx inbox (R197): a runner started on an inbox table that does not exist. Each
//! delivery that cannot land is a warn line naming `create_inbox_schema` and the table, with no
//! server source line (`at line 1371`) and not the outbox's `create_schema`; the embedded
//! processor's fetch fails the same way until it stops, which is an error line, and the runner
//! then ends with [`RunnerError::ProcessorStopped`] instead of going on without it. The
//! in-memory half (handler errors, terminal failures) is outbox-core's `tests/inbox_logs.rs`.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;
use txoutbox_core::CancellationToken;
use txoutbox_core::clock::ManualClock;
use txoutbox_core::inbox::scripted::{MessageFactory, ScriptedSubscription};
use txoutbox_core::inbox::{HandlerOutcome, InboxEvent, Runner, RunnerError, handler_fn};
use txoutbox_postgres::sql::{Layout, TableName};
use txoutbox_postgres::{SqlxHandlerTx, SqlxInbox};
use txoutbox_testkit::{
    HARNESS_SHARE, database_url, fresh_schema_name, reserve_connections, trial_pool,
};

/// The formatted log output, as a service's `tracing_subscriber::fmt()` writes it.
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Capture {
    type Writer = Capture;
    fn make_writer(&'a self) -> Capture {
        self.clone()
    }
}

impl Capture {
    fn all(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }
    fn lines(&self, level: &str, needle: &str) -> Vec<String> {
        self.all()
            .lines()
            .filter(|l| l.contains(&format!(" {level} ")) && l.contains(needle))
            .map(str::to_owned)
            .collect()
    }
}

#[tokio::test]
async fn op13_a_missing_inbox_table_is_named_and_a_stopped_processor_ends_the_runner() {
    let logs = Capture::default();
    // The test runtime is current-thread: the runner and its processor log on this thread.
    let _guard = tracing::subscriber::set_default(
        tracing_subscriber::fmt()
            .with_writer(logs.clone())
            .with_ansi(false)
            .finish(),
    );
    let _share = reserve_connections(HARNESS_SHARE).await;
    let pool = trial_pool(&database_url(), 3).await;
    // Never created.
    let table = TableName::new(&format!("{}.inbox_events", fresh_schema_name())).unwrap();
    let clock = Arc::new(ManualClock::starting_now());
    let sub = ScriptedSubscription::new(clock).for_group("billing", ["orders"]);
    sub.push(MessageFactory::new().nats(
        &[
            ("event_id", "m1"),
            ("topic", "orders"),
            ("partition_key", "cust-7"),
        ],
        &json!({ "n": 1 }).to_string(),
    ));
    let runner = Runner::for_subscription(SqlxInbox::sqlx(pool, &table, Layout::Plain), sub)
        .handler(handler_fn(|_row: &InboxEvent, _tx: &mut SqlxHandlerTx| {
            Box::pin(async { Ok(HandlerOutcome::completed()) })
        }))
        .processor_poll_interval(Duration::from_millis(100))
        .build()
        .unwrap();

    // Nobody cancels: the runner must end by itself, with an error.
    let ended = tokio::time::timeout(
        Duration::from_secs(30),
        runner.run(CancellationToken::new()),
    )
    .await
    .expect("the runner went on without its stopped processor");
    let err = ended.expect_err("the runner ended without an error");
    assert!(matches!(err, RunnerError::ProcessorStopped(_)), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("create_inbox_schema") && text.contains(&table.to_string()),
        "{text}"
    );

    let all = logs.all();
    let unlandable = logs.lines("WARN", "inbox delivery cannot land");
    assert!(
        !unlandable.is_empty(),
        "no unlandable-delivery line:\n{all}"
    );
    for l in &unlandable {
        for f in [
            "create_inbox_schema",
            &table.to_string(),
            "message_id=m1",
            "group=billing",
            "source=orders",
            "partition_key=cust-7",
            "SQLSTATE 42P01",
        ] {
            assert!(l.contains(f), "{f:?} missing from:\n{l}");
        }
    }
    let stopped = logs.lines("ERROR", "the embedded inbox processor stopped");
    assert_eq!(stopped.len(), 1, "{all}");
    assert!(
        stopped[0].contains("group=billing") && stopped[0].contains("create_inbox_schema"),
        "{}",
        stopped[0]
    );
    assert!(!all.contains(" at line "), "a server source line:\n{all}");
    assert!(
        !all.contains("create it with create_schema"),
        "the outbox's hint on an inbox table:\n{all}"
    );
}
