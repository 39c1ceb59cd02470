//! `--store diesel` (cargo feature `diesel`): the inbox of outbox-diesel on diesel-async; the
//! handler gets the `AsyncPgConnection` inside the inbox transaction and writes the ledger row
//! through it, so the row and the inbox row commit together.
#![cfg(feature = "diesel")]

use async_trait::async_trait;
use diesel::sql_types::{BigInt, Integer, Nullable, Text, Uuid};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use txoutbox_core::inbox::{Handler, HandlerError, HandlerOutcome, InboxEvent};
use txoutbox_diesel::{Layout, PoolSettings, build_pool};
use txoutbox_diesel::{create_inbox_schema, diesel_inbox};

use txoutbox_core::CancellationToken;

use crate::{
    Args, Bill, BoxError, consume, ledger_ddl, stopped_during_start_up, tables, until_ready,
};

/// Creates the tables and consumes.
pub async fn run(args: &Args, bill: Bill, stop: &CancellationToken) -> Result<(), BoxError> {
    let (inbox_table, ledger) = tables(args)?;
    if until_ready("the database", stop, || async {
        let mut conn = txoutbox_diesel::tls::establish(&args.database_url).await?;
        create_inbox_schema(&mut conn, &inbox_table, Layout::Plain).await?;
        diesel::sql_query(ledger_ddl(&ledger))
            .execute(&mut conn)
            .await?;
        Ok(())
    })
    .await
    .is_none()
    {
        return stopped_during_start_up();
    }
    let pool = build_pool(
        &args.database_url,
        &PoolSettings::default().max_size(args.max_connections as usize)?,
    )?;
    let inbox = diesel_inbox(pool, &inbox_table, Layout::Plain);
    consume(args, inbox, bill, stop).await
}

#[async_trait]
impl Handler<AsyncPgConnection> for Bill {
    async fn handle(
        &self,
        row: &InboxEvent,
        conn: &mut AsyncPgConnection,
    ) -> Result<HandlerOutcome, HandlerError> {
        let Some(o) = self.order(row)? else {
            return Ok(HandlerOutcome::skipped("not an order.placed payload"));
        };
        diesel::sql_query(self.insert())
            .bind::<Text, _>(&row.message_id)
            .bind::<Nullable<Uuid>, _>(o.id)
            .bind::<Text, _>(&o.customer)
            .bind::<Integer, _>(o.seq)
            .bind::<BigInt, _>(o.total_cents)
            .execute(conn)
            .await
            .map_err(|e| HandlerError::new(format!("ledger insert: {e}")))?;
        self.billed(row, &o);
        Ok(HandlerOutcome::completed())
    }
}
