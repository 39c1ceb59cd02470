//! The shared conformance suite against the diesel backend on the machine's PostgreSQL
//! (`DATABASE_URL`, default `postgres://postgres@127.0.0.1:5432/test`), a fresh schema per
//! trial; the peer backend of PG-06 and S-02 is outbox-postgres's sqlx backend on the same table.

use txoutbox_testkit::diesel as common;

txoutbox_conformance::suite!(postgres: common::DieselFactory::new());

/// The whole suite again with every relay delivering in one transaction (R84), plus TX-01 to
/// TX-05; trial names start with `transaction::`.
mod transaction {
    use super::common;
    use txoutbox_conformance::InTransaction;

    txoutbox_conformance::suite!(postgres_transaction: InTransaction(common::DieselFactory::new()));
}
