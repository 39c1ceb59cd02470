//! The shared conformance suite against the diesel backend on the machine's PostgreSQL
//! (`DATABASE_URL`, default `postgres://postgres@127.0.0.1:5432/test`), a fresh schema per
//! trial; the peer backend of PG-06 and S-02 is outbox-postgres's sqlx backend on the same table.

mod common;

outbox_conformance::suite!(postgres: common::DieselFactory::new());
