//! The shared conformance suite against the sqlx backend on the machine's PostgreSQL
//! (`DATABASE_URL`, default `postgres://postgres@127.0.0.1:5432/test`), a fresh schema per trial.

use outbox_postgres::testing::PgFactory;

outbox_conformance::suite!(postgres: PgFactory::new());
