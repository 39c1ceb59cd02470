//! The shared conformance suite against the diesel backend with the partitioned layout (the
//! table created by the partitioned migration, `DieselFactory::partitioned`): every `[all]`
//! scenario and every `[pg]` scenario but PG-02 and PG-10, which are about the plain table of
//! Appendix A (see `txoutbox_conformance::suite!`; their partitioned forms run against the shared
//! DDL in outbox-postgres's `tests/partitioned.rs`). The peer backend of PG-06 and S-02 is the
//! sqlx backend in the partitioned layout on the same table.

use txoutbox_testkit::diesel as common;

txoutbox_conformance::suite!(postgres_partitioned: common::DieselFactory::partitioned());
