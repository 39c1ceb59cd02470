//! omni-box 0.3.1 as a peer on one inbox table, for the `[peer]` scenarios (Z-05, Z-06).
//!
//! [`OmniBoxPeer`] runs `conformance/peer/omnibox_peer.py` with the interpreter of the virtual
//! environment that `scripts/omnibox install` makes (`OMNIBOX_PYTHON` names another) and talks
//! to it in JSON lines: each call sends one request and waits for its reply, and calls run
//! concurrently, so a test can start an omni-box landing that blocks on a lock, or a handler held
//! at a gate, and go on with this library's side. The peer uses omni-box's own classes only
//! (`InboxConsumerRunner`, `create_inbox_processor`, `PostgresInboxRepository`); its handlers
//! write one effect in the inbox transaction with [`PeerTable::effects_insert`]. A missing interpreter or package is an error that says how to install it: the
//! scenarios fail, they never skip.

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::{Mutex, oneshot};

/// The interpreter `scripts/omnibox install` sets up.
pub const DEFAULT_OMNIBOX_PYTHON: &str = "/opt/outbox-ci/omnibox-venv/bin/python";

/// How long one request may take before the call fails (a landing that waits on a lock is
/// released by the test well within it).
pub const PEER_PATIENCE: Duration = Duration::from_secs(60);

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Value>>>>;

/// Where the peer's table is.
#[derive(Debug, Clone)]
pub struct PeerTable {
    /// A PostgreSQL URL (`postgres://…`).
    pub database_url: String,
    /// The schema holding the inbox table and `effects`.
    pub schema: String,
    /// The inbox table's name.
    pub table: String,
    /// Whether the table is the partitioned layout.
    pub partitioned: bool,
    /// The consumer group the peer's runner and processor serve.
    pub group: String,
    /// The peer's worker id.
    pub worker: String,
    /// The SQL its handlers run to write an effect, `:m` bound to the message id (SQLAlchemy's
    /// placeholder), e.g. `INSERT INTO "s".effects (message_id) VALUES (:m)`.
    pub effects_insert: String,
}

/// A running omni-box peer process.
#[derive(Debug)]
pub struct OmniBoxPeer {
    child: Child,
    stdin: Mutex<ChildStdin>,
    pending: Pending,
    next: AtomicU64,
}

/// A failure of the peer: it could not start, or a request failed on its side.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// The interpreter could not be started.
    #[error(
        "cannot start omni-box's peer with {python}: {source}; run `scripts/omnibox install` (or set OMNIBOX_PYTHON to a Python >= 3.12 with omni-box[postgres]==0.3.1)"
    )]
    Spawn {
        /// The interpreter tried.
        python: String,
        /// Why it failed.
        source: std::io::Error,
    },
    /// The peer answered with an error.
    #[error("omni-box peer: {op} failed: {error}")]
    Failed {
        /// The operation.
        op: String,
        /// omni-box's error text.
        error: String,
    },
    /// The peer went away or did not answer in time.
    #[error("omni-box peer: {0}")]
    Gone(String),
}

impl OmniBoxPeer {
    /// Starts the peer and points it at `table`.
    pub async fn start(table: &PeerTable) -> Result<Self, PeerError> {
        let python =
            std::env::var("OMNIBOX_PYTHON").unwrap_or_else(|_| DEFAULT_OMNIBOX_PYTHON.to_owned());
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/peer/omnibox_peer.py");
        let mut child = Command::new(&python)
            .arg(script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| PeerError::Spawn {
                python: python.clone(),
                source,
            })?;
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = child.stdout.take().expect("piped stdout");
        let pending: Pending = Arc::default();
        let replies = pending.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let Ok(v) = serde_json::from_str::<Value>(&line) else {
                    eprintln!("omni-box peer (not a reply): {line}");
                    continue;
                };
                if let Some(id) = v.get("id").and_then(Value::as_u64)
                    && let Some(tx) = replies.lock().await.remove(&id)
                {
                    let _ = tx.send(v);
                }
            }
        });
        let peer = Self {
            child,
            stdin: Mutex::new(stdin),
            pending,
            next: AtomicU64::new(1),
        };
        peer.call(json!({
            "op": "init",
            "dsn": table.database_url,
            "schema": table.schema,
            "table": table.table,
            "partitioned": table.partitioned,
            "group": table.group,
            "worker": table.worker,
            "effects_insert": table.effects_insert,
        }))
        .await?;
        Ok(peer)
    }

    /// Sends one request (`{"op": …, …}`) and waits for its reply.
    pub async fn call(&self, mut request: Value) -> Result<Value, PeerError> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let op = request["op"].as_str().unwrap_or("?").to_owned();
        request["id"] = json!(id);
        let (tx, rx) = oneshot::channel();
        self.pending.lock().await.insert(id, tx);
        {
            let mut stdin = self.stdin.lock().await;
            let mut line = request.to_string();
            line.push('\n');
            stdin
                .write_all(line.as_bytes())
                .await
                .map_err(|e| PeerError::Gone(format!("{op}: cannot write the request: {e}")))?;
            stdin
                .flush()
                .await
                .map_err(|e| PeerError::Gone(e.to_string()))?;
        }
        let reply = tokio::time::timeout(PEER_PATIENCE, rx)
            .await
            .map_err(|_| PeerError::Gone(format!("{op}: no reply in {PEER_PATIENCE:?}")))?
            .map_err(|_| PeerError::Gone(format!("{op}: the peer exited")))?;
        if reply["ok"].as_bool() == Some(true) {
            Ok(reply)
        } else {
            Err(PeerError::Failed {
                op,
                error: reply["error"].as_str().unwrap_or("?").to_owned(),
            })
        }
    }

    /// omni-box's `InboxConsumerRunner.process_one` on one message (`{"message_id", "source",
    /// "event_type", "payload"}`), with a handler writing an effect or without one. The reply
    /// has `committed`, `processed`, `duplicate`, `event_id`.
    pub async fn runner(&self, message: Value, handler: bool) -> Result<Value, PeerError> {
        self.call(json!({"op": "runner", "message": message, "handler": handler}))
            .await
    }

    /// As [`Self::runner`], the handler held at `gate` until [`Self::open`].
    pub async fn runner_gated(&self, message: Value, gate: &str) -> Result<Value, PeerError> {
        self.call(json!({"op": "runner", "message": message, "handler": true, "gate": gate}))
            .await
    }

    /// One batch of omni-box's inbox processor in one transaction; the reply's `processed`
    /// lists the row ids it completed.
    pub async fn process(&self, batch: u32) -> Result<Value, PeerError> {
        self.call(json!({"op": "process", "batch": batch})).await
    }

    /// As [`Self::process`], each handler held at `gate` until [`Self::open`].
    pub async fn process_gated(&self, batch: u32, gate: &str) -> Result<Value, PeerError> {
        self.call(json!({"op": "process", "batch": batch, "gate": gate}))
            .await
    }

    /// `PostgresInboxRepository.create(m)` in a transaction of its own; with a gate, the
    /// transaction stays open after the create until [`Self::open`]. The reply has `row_id`
    /// and `inserted`.
    pub async fn create(&self, message: Value, gate: Option<&str>) -> Result<Value, PeerError> {
        self.call(json!({"op": "create", "message": message, "gate": gate}))
            .await
    }

    /// Waits until the handler (or open transaction) held at `gate` has started.
    pub async fn started(&self, gate: &str) -> Result<(), PeerError> {
        self.call(json!({"op": "started", "gate": gate}))
            .await
            .map(|_| ())
    }

    /// Lets what is held at `gate` go on.
    pub async fn open(&self, gate: &str) -> Result<(), PeerError> {
        self.call(json!({"op": "open", "gate": gate}))
            .await
            .map(|_| ())
    }

    /// Closes the peer's connections and ends the process.
    pub async fn stop(mut self) {
        let _ = self.call(json!({"op": "close"})).await;
        drop(self.stdin);
        let _ = tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await;
        let _ = self.child.kill().await;
    }
}
