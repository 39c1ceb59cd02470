//! The inbox scenarios on the sqlx store, partitioned table (Appendix D, R111, R164). Run with
//! `-- --test-threads 4`.

txoutbox_conformance::inbox_suite!(postgres_partitioned: txoutbox_testkit::inbox::PgInboxFactory::partitioned());

/// E-14 on a partitioned table with one partition for a past month only.
mod past_partition {
    #[allow(unused_imports)]
    use super::*;

    txoutbox_conformance::inbox_suite!(postgres_past_partition: txoutbox_testkit::inbox::PgInboxFactory::past_partition_only());
}
