//! Test support of the txoutbox workspace, for tests only (`publish = false`): the conformance
//! harness of the sqlx backend, the inbox harness, and the broker fault trials on PostgreSQL.
//! Library crates never depend on it; their tests do (a dev-dependency), so neither the harness
//! nor the conformance suite reaches a user's build. It turns on txoutbox-postgres's `test-hooks`.
//!
//! The outbox harness: a fresh schema per trial, so trials run in parallel.
//!
//! * [`PgFactory`] makes a [`PgHarness`] per trial: a schema `obx_<random>`, the outbox table
//!   in it (default name `outbox_events`, or another validated name), an `aggregates` table
//!   for the writers' application lock, and a small pool whose sessions run with
//!   `TimeZone = 'America/New_York'` (so the time-zone trap of R79 is exercised by every trial,
//!   and PG-09 checks it). The schema is dropped when the harness is dropped.
//! * `advance(d)` shifts every row's times back by d
//!   ([`txoutbox_postgres::sql::Statements::shift_clock`]).
//! * `sql` runs a statement on the harness's pool, `{table}` replaced by the quoted qualified
//!   table name and `{schema}` by the quoted schema; statements that return rows (SELECT, WITH,
//!   or with RETURNING) come back as JSON objects, others run as a simple query and return none.
//! * [`plan`] checks the plans of the plan-stability tests (outbox and inbox).
//! * [`fixtures`]: the SQL of the harnesses' own tables (aggregates, schema drop), shared with
//!   outbox-diesel's harness.
//! * [`inbox`]: the inbox harness ([`inbox::PgInboxFactory`]).
//! * To act as the *peer* backend of another harness (outbox-diesel's PG-06 and S-02), use
//!   [`PgHarness::attach`] on that harness's schema and table, then
//!   [`PgHarness::sqlx_repository`] and [`PgHarness::begin_tx`].
//! * [`diesel`] (feature `diesel`): the same harnesses on outbox-diesel's store
//!   ([`diesel::DieselFactory`], [`diesel::inbox::DieselInboxFactory`]), with the sqlx harness as
//!   their peer.
//! * The broker fault trials ([`broker_outage_recovers_within_bounds`], [`postgres_to_broker`])
//!   for the broker crates' tests.
//!
//! The database URL comes from `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`); an unreachable database fails the trial.
#![deny(missing_docs)]

mod budget;
#[cfg(feature = "diesel")]
pub mod diesel;
mod end_to_end;
mod faults;
pub mod fixtures;
mod harness;
pub mod inbox;
pub mod logs;
pub mod plan;
pub mod pooler;
pub mod shapes;

pub use budget::*;
pub use end_to_end::*;
pub use faults::*;
pub use harness::*;
