//! The inbox scenarios on the sqlx store, partitioned table (Appendix D, R111, R164). Run with
//! `-- --test-threads 4`.

outbox_conformance::inbox_suite!(postgres_partitioned: outbox_postgres::inbox::testing::PgInboxFactory::partitioned());
