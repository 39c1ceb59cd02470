//! The inbox (contract Part II): deduplicated, transactional, per-key ordered consumption.
//!
//! A broker delivers at least once; the inbox makes a processed message's database effect happen
//! exactly once. The pieces, each in a file named after it:
//!
//! * [`model`]: the stored row [`InboxEvent`], the validated [`NewInboxEvent`], the inbox key, and
//!   why a delivery is invalid (R100 to R106, R139);
//! * [`decode`](mod@decode): from a broker message to an event (R137, R138, R141);
//! * [`subscription`]: the [`Subscription`], [`InboxDelivery`] and [`AckHandle`] an adapter
//!   implements (R113);
//! * [`repository`]: the backend contract, [`InboxRepository`], [`InboxTransaction`] and
//!   [`InboxBackend`] (R107 to R112, R149 to R152, R161 to R164);
//! * [`handler`]: the [`Handler`] trait, whose transaction type is the backend's, the closure
//!   form [`handler_fn`], and the one way a handler run goes (R117, R118, R181);
//! * [`policy`]: record, rewind and at_most_once, with the ancestor's aliases (R123 to R131);
//! * [`runner`]: the consumer runner (R114 to R132, R166, R167, R182);
//! * [`processor`]: the inbox processor (R148 to R159);
//! * [`ordering`]: the inbox key's order, by the outbox's rules (R143 to R150);
//! * [`memory`]: the in-memory reference backend;
//! * [`hooks`], [`spans`] and (feature `metrics`) `metrics`: observability (R168 to R171);
//! * `scripted` (feature `testing`): the suite's scripted subscription;
//! * [`transport`]: the broker transport layer an adapter implements (semver-exempt), over
//!   which one generic subscription owns the read-ahead buffer and the bounded rewinds.
//!
//! The conformance suite's inbox scenarios (`txoutbox_conformance::inbox`) check these rules on
//! every backend; each trait method names the scenarios that check it.

pub mod decode;
pub mod handler;
pub mod hooks;
mod logs;
pub mod memory;
#[cfg(feature = "metrics")]
pub mod metrics;
pub mod model;
pub mod ordering;
pub mod policy;
pub mod processor;
pub mod repository;
pub mod runner;
#[cfg(any(test, feature = "testing"))]
pub mod scripted;
pub mod spans;
pub mod subscription;
pub mod transport;

pub use decode::{BrokerMessage, DecodeOptions, decode};
pub use handler::{Handler, HandlerError, HandlerFn, HandlerFuture, HandlerOutcome, handler_fn};
pub use hooks::{FallbackReason, InboxHooks, TransactionReport, TransactionSide};
pub use memory::{InMemoryInbox, MemInboxTx};
pub use model::{ConsumerGroup, InboxEvent, InboxKey, InvalidMessage, NewInboxEvent, PayloadError};
pub use policy::{AckStrategy, AncestorAckSettings, CommitOffsetPolicy, FailurePolicy, OnFailure};
pub use processor::{InboxCycleReport, Processor, ProcessorBuilder, ProcessorError, RowReport};
pub use repository::{
    HandlerTx, InboxBackend, InboxCapabilities, InboxFetchRequest, InboxFetched, InboxRepository,
    InboxTransaction, UndecodableInboxRow,
};
pub use runner::run_loop::RunnerError;
pub use runner::{DeliveryOutcome, DeliveryResult, Runner, RunnerBuilder};
pub use subscription::{AckHandle, InboxDelivery, RunnerSettings, Subscription, SubscriptionError};
