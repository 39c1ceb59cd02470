//! OP-13 (operations.md, R197) on a Postgres inbox store, for every driver: a runner started on
//! an inbox table that does not exist. [`op_13_missing_inbox_table`] runs it and asserts the
//! lines a user sees, captured from the `fmt` subscriber a service installs ([`Capture`]).

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;
use txoutbox_core::CancellationToken;
use txoutbox_core::clock::ManualClock;
use txoutbox_core::inbox::repository::{HandlerTx, InboxBackend};
use txoutbox_core::inbox::scripted::{MessageFactory, ScriptedSubscription};
use txoutbox_core::inbox::{Handler, Runner, RunnerError};
use txoutbox_postgres::sql::TableName;

/// The formatted log output, as a service's `tracing_subscriber::fmt()` writes it.
#[derive(Clone, Default)]
pub struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("capture").extend_from_slice(buf);
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
    /// Captures the events of this thread (a current-thread test runtime: every task of the
    /// test) until the guard drops.
    pub fn install(&self) -> tracing::subscriber::DefaultGuard {
        tracing::subscriber::set_default(
            tracing_subscriber::fmt()
                .with_writer(self.clone())
                .with_ansi(false)
                .finish(),
        )
    }

    /// Everything captured.
    pub fn all(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("capture")).into_owned()
    }

    /// The lines at `level` (`WARN`, `ERROR`) that contain `needle`.
    pub fn lines(&self, level: &str, needle: &str) -> Vec<String> {
        self.all()
            .lines()
            .filter(|l| l.contains(&format!(" {level} ")) && l.contains(needle))
            .map(str::to_owned)
            .collect()
    }
}

/// OP-13's Postgres half: `inbox` is a store on `table`, which does not exist; `handler` any
/// handler of the store. Each delivery that cannot land is a warn line naming
/// `create_inbox_schema` and the table (not the outbox's `create_schema`) with no server source
/// line (`at line N`); the embedded processor's fetch fails the same way until it stops, an
/// error line; and [`Runner::run`] ends by itself with [`RunnerError::ProcessorStopped`].
/// `sqlstate`: whether the driver reports the SQLSTATE (sqlx does, diesel-async does not for
/// this class). Call it inside a current-thread runtime (`#[tokio::test]`).
pub async fn op_13_missing_inbox_table<B: InboxBackend>(
    inbox: B,
    table: &TableName,
    handler: impl Handler<HandlerTx<B>> + 'static,
    sqlstate: bool,
) {
    let logs = Capture::default();
    let _guard = logs.install();
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
    let runner = Runner::for_subscription(inbox, sub)
        .handler(handler)
        .processor_poll_interval(Duration::from_millis(100))
        .build()
        .expect("runner");

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
    let mut fields = vec![
        "create_inbox_schema".to_owned(),
        table.to_string(),
        "message_id=m1".into(),
        "group=billing".into(),
        "source=orders".into(),
        "partition_key=cust-7".into(),
    ];
    if sqlstate {
        fields.push("SQLSTATE 42P01".into());
    }
    for l in &unlandable {
        for f in &fields {
            assert!(l.contains(f.as_str()), "{f:?} missing from:\n{l}");
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
