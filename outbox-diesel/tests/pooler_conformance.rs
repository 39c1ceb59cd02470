//! OP-08 on the diesel-async store: the outbox scenarios of sections 1 to 9 in both delivery
//! modes through PgBouncer in transaction mode (`scripts/pgbouncer start`;
//! `OUTBOX_TEST_POOLER_URL`, default 127.0.0.1:6432) with `Pooler::Transaction` (R194): each
//! trial's repository and writer transactions go through the proxy, its migrations, fixtures
//! and sqlx peer stay direct (`DieselFactory::through_pooler`). Run with `-- --test-threads 4`.

use txoutbox_testkit::diesel as common;

fn factory() -> common::DieselFactory {
    common::DieselFactory::new().through_pooler()
}

txoutbox_conformance::suite!(other: factory());

/// The scenarios of both delivery modes again with every relay delivering in one transaction
/// (R84); trial names start with `transaction::`.
mod transaction {
    use txoutbox_conformance::InTransaction;

    txoutbox_conformance::suite!(@both InTransaction(super::factory()));
    txoutbox_conformance::suite!(@tests InTransaction(super::factory()); tx::tx_01, tx::tx_02,
        tx::tx_02_commit, tx::tx_02_rollback, tx::tx_03, tx::tx_04, tx::tx_05);
}
