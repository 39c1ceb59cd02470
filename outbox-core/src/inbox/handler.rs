//! The handler (contract R117, R118, R181) and the one way a handler run goes, in the runner's T
//! and the processor's T_row alike.
//!
//! A [`Handler`] gets the stored row and a mutable borrow of the backend's own transaction type
//! (the in-memory unit of work, a sqlx transaction, a diesel-async connection inside its
//! transaction): every database write that belongs to the message goes through it, so it
//! commits or rolls back with the row's outcome (R115, R119). It must not commit or roll that
//! transaction back. [`run_handler`] sets a savepoint, runs the handler under the handler
//! timeout, catches a panic, and rolls back to the savepoint after any failure (R181).

use std::future::Future;
use std::marker::PhantomData;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use futures::FutureExt;

use crate::error::RepositoryError;
use crate::inbox::model::InboxEvent;
use crate::inbox::repository::InboxTransaction;

/// What a handler run returned (R118).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandlerOutcome {
    /// Done: the row is completed. The status text is reported, never stored.
    Completed {
        /// Optional status text (R122, R157, R170).
        status: Option<String>,
    },
    /// Not for this handler: the row is completed without effect (R155).
    Skipped {
        /// The reason (`Explicitly skipped` when none).
        reason: Option<String>,
        /// Optional status text.
        status: Option<String>,
    },
    /// Try again later.
    Retry {
        /// The failure text (empty becomes `Unknown error`, R9).
        text: String,
        /// Whether an attempt is spent (default true).
        counted: bool,
        /// An explicit retry time (R44).
        at: Option<DateTime<Utc>>,
    },
}

impl HandlerOutcome {
    /// Completed without a status.
    pub fn completed() -> Self {
        Self::Completed { status: None }
    }
    /// Completed with a status text.
    pub fn completed_with(status: impl Into<String>) -> Self {
        Self::Completed {
            status: Some(status.into()),
        }
    }
    /// Skipped with a reason (empty means none).
    pub fn skipped(reason: impl Into<String>) -> Self {
        let r: String = reason.into();
        Self::Skipped {
            reason: (!crate::event::trim_ancestor(&r).is_empty()).then_some(r),
            status: None,
        }
    }
    /// A counted retry.
    pub fn retry(text: impl Into<String>) -> Self {
        Self::Retry {
            text: text.into(),
            counted: true,
            at: None,
        }
    }
    /// A retry that spends no attempt, optionally at a time.
    pub fn retry_not_counted(text: impl Into<String>, at: Option<DateTime<Utc>>) -> Self {
        Self::Retry {
            text: text.into(),
            counted: false,
            at,
        }
    }
}

/// A handler's error: counted unless marked transient (R118). Its display becomes last_error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandlerError {
    /// The text.
    pub message: String,
    /// Whether it spends no attempt (retried after 1.0 s).
    pub transient: bool,
}

impl HandlerError {
    /// A counted error with this text.
    pub fn new(message: impl std::fmt::Display) -> Self {
        Self {
            message: message.to_string(),
            transient: false,
        }
    }
    /// A transient error (a downstream outage).
    pub fn transient(message: impl std::fmt::Display) -> Self {
        Self {
            message: message.to_string(),
            transient: true,
        }
    }
}

impl std::fmt::Display for HandlerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl<E: std::error::Error> From<E> for HandlerError {
    fn from(e: E) -> Self {
        Self::new(e)
    }
}

/// The consumer's code for one message (R181). `Tx` is the backend's transaction type.
///
/// A closure does as well, without `async-trait` in the consumer's code: [`handler_fn`].
#[async_trait]
pub trait Handler<Tx: Send>: Send + Sync {
    /// Handles the stored row inside the open transaction `tx`.
    async fn handle(&self, row: &InboxEvent, tx: &mut Tx) -> Result<HandlerOutcome, HandlerError>;
}

/// The future of a closure handler ([`handler_fn`]): boxed, because it borrows the row and the
/// transaction across its awaits, and a closure cannot name such a future's type on stable Rust.
/// `Box::pin(async move { … })` makes one.
pub type HandlerFuture<'a> =
    Pin<Box<dyn Future<Output = Result<HandlerOutcome, HandlerError>> + Send + 'a>>;

/// A [`Handler`] made of a closure by [`handler_fn`].
pub struct HandlerFn<F, Tx> {
    f: F,
    _tx: PhantomData<fn(&mut Tx)>,
}

impl<F, Tx> std::fmt::Debug for HandlerFn<F, Tx> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandlerFn")
            .field("tx", &std::any::type_name::<Tx>())
            .finish_non_exhaustive()
    }
}

/// A handler made of a closure, as tower's `service_fn` makes a service: no `async-trait` in the
/// consumer's code. The closure gets the stored row and the open transaction and returns
/// `Box::pin(async move { … })`; every rule of [`Handler`] holds for it (its writes go through
/// `tx`; it does not commit or roll back; a panic, an error or the handler timeout undoes them,
/// R181). Name the transaction type in the closure's parameters when the compiler cannot infer it
/// (the sqlx store's is `txoutbox_postgres::SqlxHandlerTx`, the in-memory one's
/// [`MemInboxTx`](crate::inbox::MemInboxTx)):
///
/// ```
/// use txoutbox_core::inbox::{HandlerOutcome, InboxEvent, MemInboxTx, handler_fn};
///
/// #[derive(serde::Deserialize)]
/// struct Placed {
///     order: String,
/// }
///
/// let bill = handler_fn(|row: &InboxEvent, tx: &mut MemInboxTx| {
///     Box::pin(async move {
///         let placed: Placed = row.payload_as()?; // a counted failure when it does not decode
///         tx.record(serde_json::json!({ "billed": placed.order }));
///         Ok(HandlerOutcome::completed())
///     })
/// });
/// # let _: &dyn txoutbox_core::inbox::Handler<MemInboxTx> = &bill;
/// ```
///
/// Checked by the handler tests of this module and, as every handler, by the inbox scenarios.
pub fn handler_fn<Tx, F>(f: F) -> HandlerFn<F, Tx>
where
    Tx: Send,
    F: for<'a> Fn(&'a InboxEvent, &'a mut Tx) -> HandlerFuture<'a> + Send + Sync,
{
    HandlerFn {
        f,
        _tx: PhantomData,
    }
}

impl<Tx, F> Handler<Tx> for HandlerFn<F, Tx>
where
    Tx: Send,
    F: for<'a> Fn(&'a InboxEvent, &'a mut Tx) -> HandlerFuture<'a> + Send + Sync,
{
    fn handle<'s, 'r, 't, 'f>(&'s self, row: &'r InboxEvent, tx: &'t mut Tx) -> HandlerFuture<'f>
    where
        's: 'f,
        'r: 'f,
        't: 'f,
        Self: 'f,
    {
        (self.f)(row, tx)
    }
}

/// A shared handler is a handler: [`RunnerBuilder::handler`](crate::inbox::RunnerBuilder::handler)
/// takes an `Arc` as well as the handler itself.
#[async_trait]
impl<Tx: Send, H: Handler<Tx> + ?Sized> Handler<Tx> for std::sync::Arc<H> {
    async fn handle(&self, row: &InboxEvent, tx: &mut Tx) -> Result<HandlerOutcome, HandlerError> {
        (**self).handle(row, tx).await
    }
}

/// How a failed run is retried (R118's classes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailureClass {
    /// Spends an attempt; retried with the backoff or at `at` (R38, R44).
    Counted {
        /// Explicit retry time.
        at: Option<DateTime<Utc>>,
    },
    /// Spends no attempt; retried at `at`, else after 1.0 s (R43, R44, D39).
    NotCounted {
        /// Explicit retry time.
        at: Option<DateTime<Utc>>,
    },
    /// An error marked transient: no attempt, retried after 1.0 s (R43).
    Transient,
}

/// A failed handler run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The error text (not yet normalized).
    pub error: String,
    /// Its class.
    pub class: FailureClass,
}

/// What one handler run ended in (R118).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunResult {
    /// Success.
    Completed {
        /// Status text.
        status: Option<String>,
    },
    /// Skip.
    Skipped {
        /// The reason, `Explicitly skipped` when none.
        reason: String,
        /// Status text.
        status: Option<String>,
    },
    /// A failure of any class.
    Failed(Failure),
}

impl RunResult {
    /// Whether the run failed.
    pub fn is_failure(&self) -> bool {
        matches!(self, RunResult::Failed(_))
    }
    /// The handler status, when one was given.
    pub fn status(&self) -> Option<&str> {
        match self {
            RunResult::Completed { status } | RunResult::Skipped { status, .. } => {
                status.as_deref()
            }
            RunResult::Failed(_) => None,
        }
    }
}

/// A handler run's result and whether its transaction is still usable (R181).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandlerRun {
    /// The outcome.
    pub result: RunResult,
    /// False when the rollback to the savepoint failed: the transaction must be rolled back
    /// and the outcome written in a fresh one under a guard (R126, R152).
    pub usable: bool,
    /// How long the run took.
    pub duration: Duration,
}

/// The timeout text of R118, `{t}` as R36 prints it (`0.05`, `30.0`).
pub fn timeout_text(t: Duration) -> String {
    let s = format!("{}", t.as_secs_f64());
    let s = if s.contains('.') { s } else { format!("{s}.0") };
    format!("Handler execution timed out after {s}s")
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    let msg = p
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| p.downcast_ref::<String>().cloned());
    match msg {
        Some(m) if !m.is_empty() => format!("Handler panicked: {m}"),
        _ => "Handler panicked".to_owned(),
    }
}

/// Runs `handler` on `row` in `tx` as R181 says: savepoint (with the statement timeout), the
/// handler under `timeout` with its panic caught, then release of the savepoint after a
/// success or a skip, and a rollback to it after a failure of any class. An error means the
/// savepoint could not be set (the transaction failed before the run: a persistence error).
pub async fn run_handler<T: InboxTransaction>(
    tx: &mut T,
    handler: &dyn Handler<T::Handle>,
    row: &InboxEvent,
    timeout: Duration,
) -> Result<HandlerRun, RepositoryError> {
    tx.savepoint(timeout).await?;
    let started = tokio::time::Instant::now();
    let fut = AssertUnwindSafe(handler.handle(row, tx.handle())).catch_unwind();
    let timed_out = || {
        RunResult::Failed(Failure {
            error: timeout_text(timeout),
            class: FailureClass::Counted { at: None },
        })
    };
    let result = match tokio::time::timeout(timeout, fut).await {
        Err(_) => timed_out(),
        // The server's statement timeout (the handler timeout, set with the savepoint) fails
        // the handler's statement no earlier than the runner's timer, and on a loaded machine
        // the error can reach the handler first: an error that arrives at or after the timeout
        // is the timeout (R118, R181), whatever its text.
        Ok(Ok(Err(_))) if started.elapsed() >= timeout => timed_out(),
        Ok(Err(panic)) => RunResult::Failed(Failure {
            error: panic_text(panic.as_ref()),
            class: FailureClass::Counted { at: None },
        }),
        Ok(Ok(Ok(HandlerOutcome::Completed { status }))) => RunResult::Completed { status },
        Ok(Ok(Ok(HandlerOutcome::Skipped { reason, status }))) => RunResult::Skipped {
            reason: reason.unwrap_or_else(|| "Explicitly skipped".to_owned()),
            status,
        },
        Ok(Ok(Ok(HandlerOutcome::Retry { text, counted, at }))) => RunResult::Failed(Failure {
            error: text,
            class: if counted {
                FailureClass::Counted { at }
            } else {
                FailureClass::NotCounted { at }
            },
        }),
        Ok(Ok(Err(e))) => RunResult::Failed(Failure {
            error: e.message,
            class: if e.transient {
                FailureClass::Transient
            } else {
                FailureClass::Counted { at: None }
            },
        }),
    };
    let duration = started.elapsed();
    let usable = if result.is_failure() {
        tx.rollback_to_savepoint().await.is_ok()
    } else {
        tx.release_savepoint().await.is_ok()
    };
    Ok(HandlerRun {
        result,
        usable,
        duration,
    })
}
