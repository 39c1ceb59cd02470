//! `--store sqlx`: the inbox of outbox-postgres on sqlx; the handler writes the ledger row with
//! the sqlx `Transaction` of the inbox transaction.

use async_trait::async_trait;
use txoutbox_core::inbox::{Handler, HandlerError, HandlerOutcome, InboxEvent};
use txoutbox_postgres::Layout;
use txoutbox_postgres::sqlx::{self, AssertSqlSafe, Postgres, Transaction};
use txoutbox_postgres::{SqlxInbox, create_inbox_schema};

use txoutbox_core::CancellationToken;

use crate::{
    Args, Bill, BoxError, consume, ledger_ddl, stopped_during_start_up, tables, until_ready,
};

/// Creates the tables and consumes.
pub async fn run(args: &Args, bill: Bill, stop: &CancellationToken) -> Result<(), BoxError> {
    let (inbox_table, ledger) = tables(args)?;
    let Some(pool) = until_ready("the database", stop, || async {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(args.max_connections)
            .connect(&args.database_url)
            .await?;
        create_inbox_schema(&pool, &inbox_table, Layout::Plain).await?;
        sqlx::query(AssertSqlSafe(ledger_ddl(&ledger)))
            .execute(&pool)
            .await?;
        Ok(pool)
    })
    .await
    else {
        return stopped_during_start_up();
    };
    let inbox = SqlxInbox::sqlx(pool, &inbox_table, Layout::Plain);
    consume(args, inbox, bill, stop).await
}

#[async_trait]
impl Handler<Transaction<'static, Postgres>> for Bill {
    async fn handle(
        &self,
        row: &InboxEvent,
        tx: &mut Transaction<'static, Postgres>,
    ) -> Result<HandlerOutcome, HandlerError> {
        let Some(o) = self.order(row)? else {
            return Ok(HandlerOutcome::skipped("not an order.placed payload"));
        };
        sqlx::query(AssertSqlSafe(self.insert()))
            .bind(&row.message_id)
            .bind(o.id)
            .bind(&o.customer)
            .bind(o.seq)
            .bind(o.total_cents)
            .execute(&mut **tx)
            .await
            .map_err(|e| HandlerError::new(format!("ledger insert: {e}")))?;
        self.billed(row, &o);
        Ok(HandlerOutcome::completed())
    }
}
