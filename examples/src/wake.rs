//! LISTEN/NOTIFY wake-ups, the relay's side. A writer built with `notify(true)`
//! (`outbox_postgres::PgOutboxWriter::notify`, `outbox_diesel::DieselOutboxWriter::notify`)
//! notifies on the table's channel (`TableName::notify_channel`) inside the caller's
//! transaction, so PostgreSQL delivers it at commit and never for a rolled-back write;
//! [`spawn_listener`] LISTENs on that channel and wakes relays, which then start a cycle at
//! once instead of waiting for their poll.

use std::sync::Arc;
use std::time::Duration;

use outbox_postgres::TableName;
use sqlx::PgPool;
use tokio::sync::Notify;

/// LISTENs on the channel of `table` on a connection of its own and wakes every waker (e.g.
/// `Relay::waker()`) on each notification, in a task that runs until the runtime stops. Returns
/// once LISTEN is in place, so a notification committed after this returns is seen. When the
/// connection drops, sqlx's listener reconnects and re-LISTENs; notifications sent meanwhile
/// are lost, which the relay's polling covers.
pub async fn spawn_listener(
    pool: &PgPool,
    table: &TableName,
    wakers: Vec<Arc<Notify>>,
) -> Result<(), sqlx::Error> {
    let channel = table.notify_channel();
    let mut l = sqlx::postgres::PgListener::connect_with(pool).await?;
    l.listen(&channel).await?;
    tracing::debug!(%channel, "listening for wake-ups");
    tokio::spawn(async move {
        loop {
            match l.recv().await {
                Ok(_) => wakers.iter().for_each(|w| w.notify_one()),
                Err(e) => {
                    tracing::warn!(error = %e, "LISTEN connection failed; polling until it is back");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    });
    Ok(())
}
