//! The shared conformance suite against the sqlx backend with the partitioned layout
//! (`PgFactory::partitioned`): every `[all]` scenario and every `[pg]` scenario but PG-02 and PG-10,
//! which are about the plain table of Appendix A (see `txoutbox_conformance::suite!`); their
//! partitioned forms are in `tests/partitioned.rs`.

use txoutbox_testkit::PgFactory;

txoutbox_conformance::suite!(postgres_partitioned: PgFactory::new().partitioned());
