//! OP-13 on the sqlx inbox (R197): a runner started on an inbox table that does not exist logs
//! each delivery that cannot land (naming `create_inbox_schema` and the table, with no server
//! source line), logs its embedded processor's stop at error, and ends with
//! `RunnerError::ProcessorStopped` ([`txoutbox_testkit::logs::op_13_missing_inbox_table`]). The
//! in-memory half (handler errors, terminal failures) is outbox-core's `tests/inbox_logs.rs`.

use txoutbox_core::inbox::{HandlerOutcome, InboxEvent, handler_fn};
use txoutbox_postgres::sql::{Layout, TableName};
use txoutbox_postgres::{SqlxHandlerTx, SqlxInbox};
use txoutbox_testkit::logs::op_13_missing_inbox_table;
use txoutbox_testkit::{
    HARNESS_SHARE, database_url, fresh_schema_name, reserve_connections, trial_pool,
};

#[tokio::test]
async fn op_13_a_missing_inbox_table_is_named_and_a_stopped_processor_ends_the_runner() {
    let _share = reserve_connections(HARNESS_SHARE).await;
    let pool = trial_pool(&database_url(), 3).await;
    // Never created.
    let table = TableName::new(&format!("{}.inbox_events", fresh_schema_name())).unwrap();
    op_13_missing_inbox_table(
        SqlxInbox::sqlx(pool, &table, Layout::Plain),
        &table,
        handler_fn(|_row: &InboxEvent, _tx: &mut SqlxHandlerTx| {
            Box::pin(async { Ok(HandlerOutcome::completed()) })
        }),
        true,
    )
    .await;
}
