//! OP-13 on the in-memory inbox (R197): the lines a user sees when a consumer's handler fails,
//! when a message fails for good, and when a delivery cannot land, captured from the `fmt`
//! subscriber a service installs. The Postgres half (a missing inbox table, a stopped embedded
//! processor and the runner's error end) is the testkit's `logs::op_13_missing_inbox_table`,
//! run by outbox-postgres's and outbox-diesel's `tests/inbox_logs.rs`.

use std::io::Write;
use std::sync::{Arc, Mutex};

use serde_json::json;
use tokio_util::sync::CancellationToken;
use txoutbox_core::clock::ManualClock;
use txoutbox_core::inbox::scripted::{MessageFactory, ScriptedSubscription};
use txoutbox_core::inbox::{
    DeliveryOutcome, HandlerError, InMemoryInbox, InboxEvent, MemInboxTx, Processor, RowReport,
    Runner, handler_fn,
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
    /// Captures this thread's events (the test runtime is current-thread) until the guard drops.
    fn install(&self) -> tracing::subscriber::DefaultGuard {
        tracing::subscriber::set_default(
            tracing_subscriber::fmt()
                .with_writer(self.clone())
                .with_ansi(false)
                .with_max_level(tracing::Level::DEBUG)
                .finish(),
        )
    }

    /// The lines at `level` (`WARN`, `ERROR`) that contain `needle`.
    fn lines(&self, level: &str, needle: &str) -> Vec<String> {
        String::from_utf8(self.0.lock().unwrap().clone())
            .unwrap()
            .lines()
            .filter(|l| l.contains(&format!(" {level} ")) && l.contains(needle))
            .map(str::to_owned)
            .collect()
    }

    fn all(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }
}

fn assert_fields(line: &str, fields: &[&str]) {
    for f in fields {
        assert!(line.contains(f), "{f:?} missing from the line:\n{line}");
    }
}

const SECRET_ERROR: &str = "card service at postgres://billing:hunter2@db/cards refused";

fn setup(sub_group: &str) -> (InMemoryInbox, ScriptedSubscription) {
    let clock = Arc::new(ManualClock::starting_now());
    (
        InMemoryInbox::new(clock.clone()),
        ScriptedSubscription::new(clock).for_group(sub_group, ["src"]),
    )
}

fn push(sub: &ScriptedSubscription, id: &str) {
    let f = MessageFactory::new();
    sub.push(f.nats(
        &[
            ("event_id", id),
            ("topic", "src"),
            ("event_type", "order.placed"),
            ("partition_key", "cust-7"),
        ],
        &json!({ "n": 1 }).to_string(),
    ));
}

fn failing() -> impl txoutbox_core::inbox::Handler<MemInboxTx> {
    handler_fn(|_row: &InboxEvent, _tx: &mut MemInboxTx| {
        Box::pin(async move { Err(HandlerError::new(SECRET_ERROR)) })
    })
}

/// A handler error the runner records: one warn line with the message, its key, the attempt,
/// the budget, the next try and the error (its password redacted); nothing at error.
#[tokio::test(start_paused = true)]
async fn a_recorded_handler_error_is_one_warn_line() {
    let logs = Capture::default();
    let _g = logs.install();
    let (inbox, sub) = setup("billing");
    push(&sub, "m1");
    let runner = Runner::for_subscription(inbox.clone(), sub.clone())
        .handler(failing())
        .max_attempts(3)
        .process_stored(false)
        .build()
        .unwrap();
    let r = runner.handle_next().await.unwrap().unwrap();
    assert_eq!(r.outcome, DeliveryOutcome::Recorded);
    let lines = logs.lines("WARN", "inbox handler failed");
    assert_eq!(lines.len(), 1, "{}", logs.all());
    assert_fields(
        &lines[0],
        &[
            "by=runner",
            "message_id=m1",
            "group=billing",
            "source=src",
            "partition_key=cust-7",
            "attempt=1",
            "max_attempts=3",
            "counted=true",
            "next_try=",
            "error=card service at postgres://billing:***@db/cards refused",
        ],
    );
    assert!(!logs.all().contains("hunter2"), "{}", logs.all());
    assert!(logs.lines("ERROR", "").is_empty(), "{}", logs.all());
}

/// The last attempt's failure: one error line saying the message failed for good and how to
/// send it again; no warn line for it.
#[tokio::test(start_paused = true)]
async fn a_terminal_failure_is_an_error_line() {
    let logs = Capture::default();
    let _g = logs.install();
    let (inbox, sub) = setup("billing");
    push(&sub, "m1");
    let runner = Runner::for_subscription(inbox.clone(), sub.clone())
        .handler(failing())
        .max_attempts(1)
        .process_stored(false)
        .build()
        .unwrap();
    let r = runner.handle_next().await.unwrap().unwrap();
    assert!(r.terminal, "{r:?}");
    let lines = logs.lines("ERROR", "failed for good");
    assert_eq!(lines.len(), 1, "{}", logs.all());
    assert_fields(
        &lines[0],
        &[
            "by=runner",
            "message_id=m1",
            "group=billing",
            "source=src",
            "partition_key=cust-7",
            "attempt=1",
            "max_attempts=1",
            "requeue-failed",
            "postgres://billing:***@db/cards",
        ],
    );
    assert!(
        logs.lines("WARN", "inbox handler failed").is_empty(),
        "{}",
        logs.all()
    );
}

/// The processor's failures: a stored row whose run fails is a warn line `by=processor`, and
/// its last attempt an error line.
#[tokio::test(start_paused = true)]
async fn the_processors_failures_are_logged_as_the_runners() {
    let logs = Capture::default();
    let _g = logs.install();
    let (inbox, sub) = setup("billing");
    push(&sub, "m1");
    // No handler: the runner lands the row for a processor.
    let lander = Runner::for_subscription(inbox.clone(), sub.clone())
        .max_attempts(2)
        .build()
        .unwrap();
    let landed = lander.handle_next().await.unwrap().unwrap();
    assert_eq!(landed.outcome, DeliveryOutcome::Landed);
    let id = landed.row_id.unwrap();
    let processor = Processor::builder(inbox.clone(), "billing", Arc::new(failing()))
        .worker_id("p1")
        .build()
        .unwrap();
    let stop = CancellationToken::new();
    let first = processor.cycle(&stop).await.unwrap();
    assert!(
        matches!(
            first.of(id),
            Some(RowReport::Counted {
                terminal: false,
                ..
            })
        ),
        "{first:?}"
    );
    let warn = logs.lines("WARN", "inbox handler failed");
    assert_eq!(warn.len(), 1, "{}", logs.all());
    assert_fields(
        &warn[0],
        &[
            "by=processor",
            "message_id=m1",
            "group=billing",
            "attempt=1",
            "max_attempts=2",
        ],
    );
    // Due again: the second and last attempt fails for good.
    inbox.set(id, |r| r.scheduled_at = r.created_at);
    let second = processor.cycle(&stop).await.unwrap();
    assert!(
        matches!(
            second.of(id),
            Some(RowReport::Counted { terminal: true, .. })
        ),
        "{second:?}"
    );
    let error = logs.lines("ERROR", "failed for good");
    assert_eq!(error.len(), 1, "{}", logs.all());
    assert_fields(
        &error[0],
        &[
            "by=processor",
            "message_id=m1",
            "attempt=2",
            "max_attempts=2",
        ],
    );
}

/// A delivery whose transaction cannot begin (the database away): a warn line with the cause
/// and what happens next.
#[tokio::test(start_paused = true)]
async fn a_delivery_that_cannot_land_is_a_warn_line_with_its_cause() {
    let logs = Capture::default();
    let _g = logs.install();
    let (inbox, sub) = setup("billing");
    push(&sub, "m1");
    let runner = Runner::for_subscription(inbox.clone(), sub.clone())
        .handler(failing())
        .process_stored(false)
        .build()
        .unwrap();
    inbox.set_down(true);
    let r = runner.handle_next().await.unwrap().unwrap();
    assert_eq!(r.outcome, DeliveryOutcome::PersistFailed);
    let lines = logs.lines("WARN", "inbox delivery cannot land");
    assert_eq!(lines.len(), 1, "{}", logs.all());
    assert_fields(
        &lines[0],
        &[
            "the database is unreachable",
            "message_id=m1",
            "group=billing",
            "source=src",
            "partition_key=cust-7",
            "error=backend unavailable",
        ],
    );
}
