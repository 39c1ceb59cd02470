#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

pub mod backoff;
mod breaker;
pub mod broker;
pub mod clock;
pub mod cloudevents;
pub mod error;
pub mod event;
mod finite;
pub mod ids;
pub mod inbox;
pub mod memory;
#[cfg(feature = "metrics")]
pub mod metrics;
pub mod ordering;
pub mod redact;
pub mod relay;
mod report;
pub mod repository;
#[cfg(any(test, feature = "testing"))]
pub mod scripted;
pub mod signal;
pub mod step;
pub mod trace;

pub use backoff::{Backoff, Jitter, RandomSource, SeededRng};
pub use broker::{Ack, Broker, Message, NoopBroker, StdoutBroker};
pub use clock::{Clock, ManualClock, ManualRelayClock, RelayClock, SystemClock, TokioClock};
pub use error::{BrokerError, ConfigError, RepositoryError, RunError, StepError, ValidationError};
pub use event::{BuildSettings, EventBuilder, NewEvent, OutboxEvent, Schedule, Status, WorkerId};
pub use memory::InMemoryRepository;
#[cfg(feature = "metrics")]
pub use metrics::MetricsStep;
pub use relay::{
    BreakerConfig, CycleReport, FailureReport, LoopBackoff, LoopControl, LoopHooks, Relay,
    RelayBuilder, RelayConfig, RowOutcome, RunOptions,
};
pub use repository::{
    BlockedKey, Capabilities, Delivery, DeliveryBound, DeliveryMode, FetchFilter, FetchRequest,
    Fetched, OutboxRepository, StatusCount, WriteResult,
};
pub use step::{ObservedOutcome, PipelineStep, StepDecision};
pub use trace::TraceParent;

/// Re-exported so users need not depend on tokio-util for the shutdown signal.
pub use tokio_util::sync::CancellationToken;
