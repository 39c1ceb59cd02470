//! The inbox scenarios on the diesel-async store, partitioned table (Appendix D, R111, R164).
//! Run with `-- --test-threads 4`.

mod common;

outbox_conformance::inbox_suite!(postgres_partitioned: common::inbox::DieselInboxFactory::partitioned());
