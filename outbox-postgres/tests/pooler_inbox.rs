//! OP-08 on the sqlx inbox: the runner and processor scenarios (N, F, Y and the rest of the
//! `[all]` set) through PgBouncer in transaction mode (`scripts/pgbouncer start`;
//! `OUTBOX_TEST_POOLER_URL`, default 127.0.0.1:6432) with `Pooler::Transaction` (R194): each
//! trial's store and handler transactions go through the proxy, its schema and fixtures stay
//! on the direct URL. Run with `-- --test-threads 4`.

txoutbox_conformance::inbox_suite!(@all txoutbox_testkit::inbox::PgInboxFactory::plain()
    .through_pooler());
