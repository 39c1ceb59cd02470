#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

pub mod backoff;
pub mod broker;
pub mod clock;
pub mod cloudevents;
pub mod error;
pub mod event;
mod finite;
pub mod ids;
pub mod memory;
#[cfg(feature = "metrics")]
pub mod metrics;
pub mod ordering;
pub mod redact;
pub mod relay;
pub mod repository;
#[cfg(any(test, feature = "testing"))]
pub mod scripted;
pub mod step;
pub mod trace;

pub use backoff::{Backoff, Jitter};
pub use broker::{Ack, Broker, Message};
pub use error::{BrokerError, ConfigError, RepositoryError, RunError, StepError, ValidationError};
pub use event::{EventBuilder, NewEvent, OutboxEvent, Schedule, Status, WorkerId};
pub use memory::InMemoryRepository;
pub use relay::{
    CycleReport, LoopBackoff, LoopControl, LoopHooks, Relay, RelayBuilder, RunOptions,
};
pub use repository::{
    Delivery, DeliveryBound, DeliveryMode, FetchFilter, FetchRequest, Fetched, OutboxRepository,
};
pub use step::{PipelineStep, StepDecision};
pub use trace::TraceParent;

/// Re-exported so users need not depend on tokio-util for the shutdown signal.
pub use tokio_util::sync::CancellationToken;
