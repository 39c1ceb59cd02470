//! OP-13 on the diesel-async inbox (R197): a runner started on an inbox table that does not
//! exist logs each delivery that cannot land (naming `create_inbox_schema` and the table),
//! logs its embedded processor's stop at error, and ends with `RunnerError::ProcessorStopped`
//! ([`txoutbox_testkit::logs::op_13_missing_inbox_table`], as on sqlx).

use diesel_async::AsyncPgConnection;
use txoutbox_core::inbox::{HandlerOutcome, InboxEvent, handler_fn};
use txoutbox_diesel::{Layout, PoolSettings, build_pool, diesel_inbox};
use txoutbox_postgres::sql::TableName;
use txoutbox_testkit::logs::op_13_missing_inbox_table;
use txoutbox_testkit::{HARNESS_SHARE, database_url, fresh_schema_name, reserve_connections};

#[tokio::test]
async fn op_13_a_missing_inbox_table_is_named_and_a_stopped_processor_ends_the_runner() {
    let _share = reserve_connections(HARNESS_SHARE).await;
    let pool = build_pool(
        &database_url(),
        &PoolSettings::default().max_size(3).unwrap(),
    )
    .unwrap();
    // Never created.
    let table = TableName::new(&format!("{}.inbox_events", fresh_schema_name())).unwrap();
    op_13_missing_inbox_table(
        diesel_inbox(pool, &table, Layout::Plain),
        &table,
        handler_fn(|_row: &InboxEvent, _conn: &mut AsyncPgConnection| {
            Box::pin(async { Ok(HandlerOutcome::completed()) })
        }),
        // diesel-async reports this class without its SQLSTATE.
        false,
    )
    .await;
}
