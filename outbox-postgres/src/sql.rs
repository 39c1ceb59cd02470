//! The one home of the Postgres SQL, shared by the sqlx backend of this crate and by
//! `outbox-diesel`. This module compiles without the `sqlx` feature and has no driver types in
//! its API: statement texts are plain `String`s with numbered bind parameters (`$1`, `$2`, …),
//! and every statement documents its parameters (order and Postgres type) and its result
//! columns.
//!
//! # Use
//!
//! 1. Validate the table name: [`TableName::new`] (R78). Only a validated name ever reaches SQL,
//!    always double-quoted; every value is a bound parameter.
//! 2. Create the schema with the statements of [`ddl`], in order, in one transaction (they are
//!    idempotent; on an existing ancestor table they add only what is missing, R79), after
//!    taking the advisory lock [`Statements::schema_lock`].
//! 3. Build [`Statements::new`] once and run its texts.
//!
//! # Bind types
//!
//! `uuid`, `text`, `int4`, `int8`, `bool`, `timestamptz`, and arrays of them (`uuid[]`, `text[]`,
//! …; array elements may be NULL where a statement says so). JSON goes in as `text` and is cast
//! in SQL (`::jsonb`), so a driver needs no JSON support to bind it. Durations are bound as
//! `int8` microseconds and turned into intervals in SQL (`$n * INTERVAL '1 microsecond'`), so
//! every time is computed on the database clock (R72).
//!
//! # Row mapping
//!
//! Every statement that returns outbox rows returns exactly the columns of [`COLUMNS`], in that
//! order (the DDL's column order). Decode them into a [`RawRow`] (the Rust type for each column
//! is given on its field) and call [`RawRow::decode`], which never fails the whole fetch: a row
//! whose headers are not a string map, or whose status is not one of the three values, becomes
//! an [`UndecodableRow`] (R82).
//!
//! # The fetch
//!
//! Two statements in one transaction: [`Statements::fetch_heads`] chooses the candidate heads
//! (path A, a window of the oldest fetchable rows read with `SKIP LOCKED`; path B, a key walk
//! bounded by the batch that resumes from a [`WalkCursor`]), then [`Statements::fetch_take`]
//! locks them in head order until the batch is full, extends them into runs and stamps the
//! lease (R19–R29, R74, R76, R85); [`Statements::fetch_take_transaction`] is the same without
//! the stamp, for delivery in one transaction (R84). Both backends run them through the one
//! fetch, `crate::outbox::fetch`, over their driver. They use the indexes of Appendix A
//! and the [`additions`], take no advisory lock, and their work is bounded by the batch
//! whatever the backlog and whatever the planner's statistics (every lookup by id goes through
//! the primary key; see `fragments` and the crate README, "Plan-stable statements").
//!
//! # Where the SQL lives
//!
//! Each statement is a file under `src/sql/statements/` (`fetch_heads.sql`, `fetch_take.sql`,
//! `blocked_keys.sql`, …) with its parameters and result columns documented at its top,
//! included at compile time; `{table}` is replaced by the validated, quoted table name.
//! Predicates shared by several statements are files under `src/sql/fragments/`, composed in
//! as `{name:alias}` when the statements are built. The DDL and the insert stay in Rust
//! because they are assembled per layout.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use txoutbox_core::event::{NewEvent, OutboxEvent, Status};
use txoutbox_core::repository::{FetchRequest, UndecodableRow};
use uuid::Uuid;

use crate::error::Error;

pub(crate) mod fragments;
pub mod partitioned;
pub use partitioned::Layout;
pub mod pooler;
pub use pooler::Pooler;

mod ddl;
mod fetch;
mod row;
mod sqlstate;
mod statements;
mod table;
#[cfg(test)]
mod tests;
mod write;

pub use ddl::*;
pub use fetch::*;
pub use row::*;
pub use sqlstate::*;
pub use statements::*;
pub use table::*;
pub use write::*;
