//! LISTEN/NOTIFY wake-ups: a writer notifies inside its own transaction, so PostgreSQL delivers
//! the notification at commit (and never for a rolled-back transaction); `outbox-relay run`
//! LISTENs on the same channel and starts a cycle at once instead of waiting for its poll.
//!
//! The channel of a table is [`channel`]: `outbox.` followed by the table as `schema.table` or
//! `table`. The payload is empty; a notification only means "look now". Notifications of one
//! transaction with the same channel and payload are folded into one by PostgreSQL, so a
//! writer may call [`notify`] once per transaction or once per event, at no extra cost.

use std::sync::Arc;
use std::time::Duration;

use outbox_postgres::TableName;
use sqlx::{PgConnection, PgPool};
use tokio::sync::Notify;

/// The channel name for `table`: `outbox.` + `schema.table` when that fits PostgreSQL's 63-byte
/// limit on channel names, else `outbox.` + a stable 64-bit FNV-1a hash of it in hex.
pub fn channel(table: &TableName) -> String {
    let name = format!("outbox.{}", table.dotted());
    if name.len() <= 63 {
        return name;
    }
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in table.dotted().bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("outbox.{h:016x}")
}

/// `SELECT pg_notify(channel, '')` on `conn`: call it inside the transaction that wrote the
/// events (pass `&mut *tx`).
pub async fn notify(conn: &mut PgConnection, table: &TableName) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_notify($1, '')")
        .bind(channel(table))
        .execute(conn)
        .await
        .map(drop)
}

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
    let channel = channel(table);
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

/// The same for diesel-async: call it inside `conn.transaction(…)`.
#[cfg(feature = "diesel")]
pub async fn notify_diesel(
    conn: &mut diesel_async::AsyncPgConnection,
    table: &TableName,
) -> Result<(), diesel::result::Error> {
    use diesel::sql_types::Text;
    use diesel_async::RunQueryDsl;
    diesel::sql_query("SELECT pg_notify($1, '')")
        .bind::<Text, _>(channel(table))
        .execute(conn)
        .await
        .map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channel_fits_postgres_limit() {
        let short = TableName::new("s1.outbox_events").unwrap();
        assert_eq!(channel(&short), "outbox.s1.outbox_events");
        let long = TableName::new(&format!("{}.{}", "s".repeat(63), "t".repeat(31))).unwrap();
        let c = channel(&long);
        assert!(c.len() <= 63, "{c}");
        assert_eq!(c, channel(&long));
        let other = TableName::new(&format!("{}.{}", "s".repeat(63), "u".repeat(31))).unwrap();
        assert_ne!(c, channel(&other));
    }
}
