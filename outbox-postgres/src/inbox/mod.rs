//! The Postgres inbox (contract Part II): the inbox table of Appendix D, plain or partitioned,
//! and the inbox store for the runner and the processor of `txoutbox_core::inbox`.
//!
//! * [`sql`]: the DDL and the statement texts (files under `src/sql/inbox/`);
//! * [`store`]: the store, written once over the driver layer ([`crate::driver::inbox`]); its
//!   fetch in `store/fetch.rs`, its transaction ([`PgInboxTx`]) in `store/transaction.rs`;
//! * `sqlx` (feature `sqlx`): the sqlx driver, whose handlers get a sqlx `Transaction`.
//!   `outbox-diesel` implements the same driver for diesel-async.

pub mod schema;
pub mod sql;
#[cfg(feature = "sqlx")]
pub mod sqlx;
pub mod store;

#[cfg(feature = "sqlx")]
pub use self::sqlx::{SqlxHandlerTx, SqlxInbox, create_inbox_schema};
#[cfg(feature = "test-hooks")]
pub use store::InboxFaults;
pub use store::{PgInbox, PgInboxTx};
