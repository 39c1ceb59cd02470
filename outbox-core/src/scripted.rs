//! A scriptable broker: the reference broker of the quick start and the conformance suite.
//!
//! Each event id has a script of [`Action`]s, used one per publish call; when a script runs out
//! the broker uses its default action (`Ok` unless changed). Every call is recorded (event id,
//! start, end, result), and every accepted message in order.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{Notify, watch};
use uuid::Uuid;

use crate::broker::{Ack, Broker, Message};
use crate::error::BrokerError;

/// A gate a publish waits at until the test opens it.
#[derive(Debug, Clone)]
pub struct Gate {
    tx: Arc<watch::Sender<bool>>,
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
            tx: Arc::new(watch::channel(false).0),
        }
    }

    /// Opens the gate for every waiting and future publish.
    pub fn open(&self) {
        self.tx.send_replace(true);
    }

    async fn wait(&self) {
        let mut rx = self.tx.subscribe();
        let _ = rx.wait_for(|open| *open).await;
    }
}

/// One scripted answer.
#[derive(Debug, Clone)]
pub enum Action {
    /// Acknowledge.
    Ok,
    /// Refuse (counted).
    Reject(String),
    /// Fail transiently.
    Transient(String),
    /// Never answer (the publish timeout fires).
    Hang,
    /// Wait for the gate, then acknowledge.
    Gate(Gate),
    /// Acknowledge after a delay.
    Delay(Duration),
}

/// One recorded publish call.
#[derive(Debug, Clone)]
pub struct Call {
    /// Event id.
    pub event_id: Uuid,
    /// Partition key.
    pub partition_key: String,
    /// When the call started (tokio clock).
    pub start: tokio::time::Instant,
    /// When it ended, if it did.
    pub end: Option<tokio::time::Instant>,
    /// Its result, if it ended.
    pub result: Option<Result<(), BrokerError>>,
}

type AckHook = Box<dyn Fn(&Message) + Send + Sync>;

#[derive(Default)]
struct State {
    scripts: HashMap<Uuid, VecDeque<Action>>,
    calls: Vec<Call>,
    accepted: Vec<Message>,
}

/// The scriptable broker. Cloning shares the same scripts and records.
#[derive(Clone)]
pub struct ScriptedBroker {
    state: Arc<Mutex<State>>,
    default: Arc<Mutex<Action>>,
    changed: Arc<Notify>,
    on_ack: Arc<Mutex<Option<AckHook>>>,
}

impl std::fmt::Debug for ScriptedBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScriptedBroker").finish_non_exhaustive()
    }
}

impl Default for ScriptedBroker {
    fn default() -> Self {
        Self::new()
    }
}

impl ScriptedBroker {
    /// A broker that acknowledges everything until scripted.
    pub fn new() -> Self {
        Self {
            state: Arc::default(),
            default: Arc::new(Mutex::new(Action::Ok)),
            changed: Arc::new(Notify::new()),
            on_ack: Arc::new(Mutex::new(None)),
        }
    }

    /// Appends actions to an event's script.
    pub fn script(&self, id: Uuid, actions: impl IntoIterator<Item = Action>) {
        self.state
            .lock()
            .expect("broker poisoned")
            .scripts
            .entry(id)
            .or_default()
            .extend(actions);
    }

    /// Sets the action used when a script is empty.
    pub fn set_default(&self, a: Action) {
        *self.default.lock().expect("broker poisoned") = a;
    }

    /// Calls `f` after each acknowledgement is recorded (before the publish returns).
    pub fn on_ack(&self, f: impl Fn(&Message) + Send + Sync + 'static) {
        *self.on_ack.lock().expect("broker poisoned") = Some(Box::new(f));
    }

    /// Every call so far.
    pub fn calls(&self) -> Vec<Call> {
        self.state.lock().expect("broker poisoned").calls.clone()
    }

    /// Ids of every call so far, in call order.
    pub fn called_ids(&self) -> Vec<Uuid> {
        self.calls().iter().map(|c| c.event_id).collect()
    }

    /// Every accepted message, in order.
    pub fn accepted(&self) -> Vec<Message> {
        self.state.lock().expect("broker poisoned").accepted.clone()
    }

    /// Ids of every accepted message, in order.
    pub fn accepted_ids(&self) -> Vec<Uuid> {
        self.accepted().iter().map(|m| m.event_id).collect()
    }

    /// Waits until `pred` holds over the recorded calls.
    pub async fn wait_for_calls(&self, pred: impl Fn(&[Call]) -> bool) {
        loop {
            let n = self.changed.notified();
            if pred(&self.state.lock().expect("broker poisoned").calls) {
                return;
            }
            n.await;
        }
    }

    fn finish(&self, idx: usize, m: &Message, result: Result<(), BrokerError>) {
        let mut st = self.state.lock().expect("broker poisoned");
        st.calls[idx].end = Some(tokio::time::Instant::now());
        st.calls[idx].result = Some(result.clone());
        if result.is_ok() {
            st.accepted.push(m.clone());
        }
        drop(st);
        if result.is_ok()
            && let Some(h) = self.on_ack.lock().expect("broker poisoned").as_ref()
        {
            h(m);
        }
        self.changed.notify_waiters();
    }
}

#[async_trait]
impl Broker for ScriptedBroker {
    async fn publish(&self, m: &Message) -> Result<Ack, BrokerError> {
        // A real broker never answers within the call that sends: yield once, so publishes the
        // relay starts together are all in flight before the first answer arrives.
        tokio::task::yield_now().await;
        let (idx, action) = {
            let mut st = self.state.lock().expect("broker poisoned");
            let action = st
                .scripts
                .get_mut(&m.event_id)
                .and_then(VecDeque::pop_front)
                .unwrap_or_else(|| self.default.lock().expect("broker poisoned").clone());
            st.calls.push(Call {
                event_id: m.event_id,
                partition_key: m.partition_key.clone(),
                start: tokio::time::Instant::now(),
                end: None,
                result: None,
            });
            (st.calls.len() - 1, action)
        };
        self.changed.notify_waiters();
        /// Marks the call ended (without result) if the publish future is dropped by a timeout.
        struct EndOnDrop<'a>(&'a ScriptedBroker, usize, bool);
        impl Drop for EndOnDrop<'_> {
            fn drop(&mut self) {
                if !self.2 {
                    if let Ok(mut st) = self.0.state.lock() {
                        st.calls[self.1].end = Some(tokio::time::Instant::now());
                    }
                    self.0.changed.notify_waiters();
                }
            }
        }
        let mut guard = EndOnDrop(self, idx, false);
        let result = match action {
            Action::Ok => Ok(()),
            Action::Reject(t) => Err(BrokerError::Rejected(t)),
            Action::Transient(t) => Err(BrokerError::Transient(t)),
            Action::Hang => std::future::pending().await,
            Action::Gate(g) => {
                g.wait().await;
                Ok(())
            }
            Action::Delay(d) => {
                tokio::time::sleep(d).await;
                Ok(())
            }
        };
        guard.2 = true;
        self.finish(idx, m, result.clone());
        result.map(|()| Ack::default())
    }
}
