//! The inbox scenarios on the sqlx store, partitioned table (Appendix D, R111, R164). Run with
//! `-- --test-threads 4`.

outbox_conformance::inbox_suite!(postgres_partitioned: outbox_postgres::inbox::testing::PgInboxFactory::partitioned());

/// E-14 on a partitioned table with one partition for a past month only.
mod past_partition {
    #[allow(unused_imports)]
    use super::*;

    outbox_conformance::inbox_suite!(postgres_past_partition: outbox_postgres::inbox::testing::PgInboxFactory::past_partition_only());
}
