//! The [pg] scenarios (PG-01 to PG-10, P-08) against the sqlx backend, until the suite macro's
//! `postgres:` arm lists them (then this file goes).

use outbox_postgres::testing::PgFactory;

outbox_conformance::suite!(@tests PgFactory::new();
    pg::pg_01, pg::pg_02, pg::pg_03, pg::pg_04, pg::pg_05, pg::pg_06,
    pg::pg_07, pg::pg_08, pg::pg_09, pg::pg_10, pg::p_08);
