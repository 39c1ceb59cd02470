//! The inbox scenarios on the diesel-async store, partitioned table (Appendix D, R111, R164).
//! Run with `-- --test-threads 4`.

use txoutbox_testkit::diesel as common;

txoutbox_conformance::inbox_suite!(postgres_partitioned: common::inbox::DieselInboxFactory::partitioned());

/// E-14 on a partitioned table with one partition for a past month only.
mod past_partition {
    #[allow(unused_imports)]
    use super::*;

    txoutbox_conformance::inbox_suite!(postgres_past_partition: super::common::inbox::DieselInboxFactory::past_partition_only());
}
