//! The inbox scenarios on the sqlx store, plain table (contract Part II). Run with
//! `-- --test-threads 4`: each trial holds a share of the harness's connection budget.

txoutbox_conformance::inbox_suite!(postgres: txoutbox_testkit::inbox::PgInboxFactory::plain());
