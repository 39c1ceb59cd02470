//! The shared Postgres driver layer (semver-exempt): traits that sqlx (this crate) and
//! diesel-async (`outbox-diesel`) implement, so the flows over them are written once.

pub mod inbox;
