//! The suite's scripted handler (scenarios.md section 19): per message id a script of actions,
//! one per run, `write` once a script runs out; every run is recorded.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use tokio::sync::watch;
use txoutbox_core::inbox::repository::HandlerTx;
use txoutbox_core::inbox::{Handler, HandlerError, HandlerOutcome, InboxEvent};
use uuid::Uuid;

use crate::inbox::harness::InboxHarness;

/// A gate a run waits at until the test opens it.
#[derive(Debug, Clone)]
pub struct Gate {
    open: Arc<watch::Sender<bool>>,
    arrived: Arc<watch::Sender<u32>>,
}

impl Default for Gate {
    fn default() -> Self {
        Self::new()
    }
}

impl Gate {
    /// A closed gate.
    pub fn new() -> Self {
        Self {
            open: Arc::new(watch::channel(false).0),
            arrived: Arc::new(watch::channel(0).0),
        }
    }
    /// Opens it.
    pub fn open(&self) {
        self.open.send_replace(true);
    }
    /// Waits until `n` runs have reached the gate.
    pub async fn reached(&self, n: u32) {
        let mut rx = self.arrived.subscribe();
        let _ = rx.wait_for(|a| *a >= n).await;
    }
    async fn pass(&self) {
        self.arrived.send_modify(|a| *a += 1);
        let mut rx = self.open.subscribe();
        let _ = rx.wait_for(|o| *o).await;
    }
}

/// A hook run by an action.
pub type Hook = Arc<dyn Fn() + Send + Sync>;

/// One scripted action.
#[derive(Clone)]
pub enum Act {
    /// Writes one effect, returns completed.
    Write,
    /// Writes one effect, then runs this SQL through the handler's transaction (Postgres
    /// harnesses only, [`InboxHarness::sql_in`]); a failed statement fails the run with the
    /// server's message (`sql_error` is `SELECT 1/0`).
    Sql(String),
    /// Returns completed with this status, no effect.
    Ok(Option<String>),
    /// Writes one effect, then returns an error with this display.
    Fail(String),
    /// Returns retry.
    Retry {
        /// Text.
        text: String,
        /// Counted.
        counted: bool,
        /// Explicit time.
        at: Option<DateTime<Utc>>,
    },
    /// Returns an error marked transient.
    Transient(String),
    /// Returns skipped with this reason (empty: none).
    Skip(String),
    /// Never returns.
    Hang,
    /// Writes one effect, waits at the gate, returns completed.
    Gate(Gate),
    /// Writes one effect, waits at the gate, returns an error.
    GateFail(Gate, String),
    /// Writes one effect, then panics.
    Panic(String),
    /// Writes one effect, runs the hook, breaks the transaction, returns an error.
    BreakTx(String, Option<Hook>),
    /// Writes one effect, breaks the transaction, returns completed (a connection lost after
    /// the handler's work, before the outcome commits with it).
    BreakTxOk,
    /// Writes one effect, returns completed after the delay.
    Delay(Duration),
    /// Draws the action at run time (the stand tests' seeded mix).
    Choose(Arc<dyn Fn() -> Act + Send + Sync>),
}

/// A recorded run.
#[derive(Debug, Clone)]
pub struct Run {
    /// The message.
    pub message_id: String,
    /// The row.
    pub row_id: Uuid,
    /// Start.
    pub start: tokio::time::Instant,
    /// End (none for a run that never ended).
    pub end: Option<tokio::time::Instant>,
}

/// The scripted handler of one trial.
pub struct ScriptedHandler<H: InboxHarness> {
    harness: Arc<H>,
    scripts: Mutex<HashMap<String, VecDeque<Act>>>,
    runs: Mutex<Vec<Run>>,
    default: Mutex<Option<Act>>,
}

impl<H: InboxHarness> ScriptedHandler<H> {
    /// A handler writing through `harness`.
    pub fn new(harness: Arc<H>) -> Self {
        Self {
            harness,
            scripts: Mutex::default(),
            runs: Mutex::default(),
            default: Mutex::default(),
        }
    }
    /// Appends actions to a message's script.
    pub fn script(&self, message_id: &str, acts: Vec<Act>) {
        self.scripts
            .lock()
            .expect("poisoned")
            .entry(message_id.to_owned())
            .or_default()
            .extend(acts);
    }
    /// The action once every script runs out (default `write`).
    pub fn always(&self, act: Act) {
        *self.default.lock().expect("poisoned") = Some(act);
    }
    /// Every recorded run.
    pub fn runs(&self) -> Vec<Run> {
        self.runs.lock().expect("poisoned").clone()
    }
    /// The message ids of the runs, in start order.
    pub fn run_ids(&self) -> Vec<String> {
        self.runs().into_iter().map(|r| r.message_id).collect()
    }
    /// How many runs `message_id` had.
    pub fn runs_of(&self, message_id: &str) -> usize {
        self.runs()
            .iter()
            .filter(|r| r.message_id == message_id)
            .count()
    }
}

#[async_trait]
impl<H: InboxHarness> Handler<HandlerTx<H::Backend>> for ScriptedHandler<H> {
    async fn handle(
        &self,
        row: &InboxEvent,
        tx: &mut HandlerTx<H::Backend>,
    ) -> Result<HandlerOutcome, HandlerError> {
        let act = self
            .scripts
            .lock()
            .expect("poisoned")
            .get_mut(&row.message_id)
            .and_then(VecDeque::pop_front)
            .or_else(|| self.default.lock().expect("poisoned").clone())
            .unwrap_or(Act::Write);
        let idx = {
            let mut runs = self.runs.lock().expect("poisoned");
            runs.push(Run {
                message_id: row.message_id.clone(),
                row_id: row.id,
                start: tokio::time::Instant::now(),
                end: None,
            });
            runs.len() - 1
        };
        let key = row.payload.get("key").and_then(|v| v.as_str());
        let n = row.payload.get("n").and_then(|v| v.as_i64()).unwrap_or(0);
        let h = self.harness.clone();
        let act = match act {
            Act::Choose(f) => f(),
            other => other,
        };
        let out = match act {
            Act::Write => h
                .write_effect(tx, &row.message_id, key, n)
                .await
                .map(|_| HandlerOutcome::completed()),
            Act::Ok(s) => Ok(HandlerOutcome::Completed { status: s }),
            Act::Sql(text) => {
                h.write_effect(tx, &row.message_id, key, n).await?;
                h.sql_in(tx, &text)
                    .await
                    .map(|_| HandlerOutcome::completed())
            }
            Act::Fail(t) => {
                h.write_effect(tx, &row.message_id, key, n).await?;
                Err(HandlerError::new(t))
            }
            Act::Retry { text, counted, at } => Ok(HandlerOutcome::Retry { text, counted, at }),
            Act::Transient(t) => Err(HandlerError::transient(t)),
            Act::Skip(r) => Ok(HandlerOutcome::skipped(r)),
            Act::Hang => std::future::pending().await,
            Act::Gate(g) => {
                h.write_effect(tx, &row.message_id, key, n).await?;
                g.pass().await;
                Ok(HandlerOutcome::completed())
            }
            Act::GateFail(g, t) => {
                h.write_effect(tx, &row.message_id, key, n).await?;
                g.pass().await;
                Err(HandlerError::new(t))
            }
            Act::Panic(t) => {
                h.write_effect(tx, &row.message_id, key, n).await?;
                std::panic::panic_any(t)
            }
            Act::BreakTx(t, hook) => {
                h.write_effect(tx, &row.message_id, key, n).await?;
                if let Some(h) = hook {
                    h();
                }
                self.harness.break_tx(tx).await;
                Err(HandlerError::new(t))
            }
            Act::BreakTxOk => {
                h.write_effect(tx, &row.message_id, key, n).await?;
                self.harness.break_tx(tx).await;
                Ok(HandlerOutcome::completed())
            }
            Act::Delay(d) => {
                h.write_effect(tx, &row.message_id, key, n).await?;
                tokio::time::sleep(d).await;
                Ok(HandlerOutcome::completed())
            }
            Act::Choose(_) => h
                .write_effect(tx, &row.message_id, key, n)
                .await
                .map(|_| HandlerOutcome::completed()),
        };
        self.runs.lock().expect("poisoned")[idx].end = Some(tokio::time::Instant::now());
        out
    }
}
