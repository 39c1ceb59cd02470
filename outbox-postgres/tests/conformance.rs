//! The shared conformance suite against the sqlx backend on the machine's PostgreSQL
//! (`DATABASE_URL`, default `postgres://postgres@127.0.0.1:5432/test`), a fresh schema per trial.

use txoutbox_testkit::PgFactory;

txoutbox_conformance::suite!(postgres: PgFactory::new());

/// The whole suite again with every relay delivering in one transaction (R84), plus TX-01 to
/// TX-05; trial names start with `transaction::`.
mod transaction {
    use txoutbox_conformance::InTransaction;
    use txoutbox_testkit::PgFactory;

    txoutbox_conformance::suite!(postgres_transaction: InTransaction(PgFactory::new()));
}
