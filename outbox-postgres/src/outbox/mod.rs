//! The outbox store on PostgreSQL, written once over the [`crate::driver`] layer: its settings
//! ([`PgConfig`]), the writer ([`Writer`]), the fetch ([`fetch`]), the repository
//! ([`Repository`]) with its outcome writes and its delivery transaction. The sqlx backend
//! names them `PgOutboxRepository` and `PgOutboxWriter`; outbox-diesel names them
//! `DieselOutboxRepository` and `DieselOutboxWriter`.

mod config;
mod delivery;
mod fetch;
mod repository;
mod writer;

pub use config::PgConfig;
pub use fetch::{fetch, heads, take};
pub use repository::Repository;
pub use writer::Writer;
