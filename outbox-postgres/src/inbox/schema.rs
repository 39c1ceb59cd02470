//! Inbox schema creation (R172, R173, R79), written once over the driver layer: the table of
//! Appendix D, the `partition_key` column and the indexes, in one transaction under an advisory
//! lock. Idempotent; on an existing table an index is added only when no index with the same
//! columns, uniqueness and predicate exists under any name (the ancestor named the indexes of
//! every table with its fixed prefixes): each index is first built on an empty LIKE copy of the
//! table, and the catalog compares the two definitions.

use txoutbox_core::error::RepositoryError;

use crate::driver::inbox::InboxRows;
use crate::driver::{Bind, Driver};
use crate::inbox::sql::{InboxSchema, schema_lock_key};
use crate::sql::{Layout, TableName};

/// Creates the inbox schema of `table` in `layout` on `conn`, which must be inside a
/// transaction the caller commits.
pub async fn create_inbox_schema_on<C: InboxRows>(
    conn: &mut C,
    table: &TableName,
    layout: Layout,
) -> Result<(), RepositoryError> {
    let s = InboxSchema::new(table, layout);
    let m = |e| C::map_err(table, e);
    conn.execute(&s.lock, vec![Bind::Text(schema_lock_key(table))])
        .await
        .map_err(m)?;
    for stmt in &s.table {
        conn.execute(stmt, Vec::new()).await.map_err(m)?;
    }
    conn.execute(&s.probe_table, Vec::new()).await.map_err(m)?;
    let schema = table.schema().unwrap_or("public");
    for (name, probe, create) in &s.indexes {
        let exists = conn
            .inbox_int8(
                &s.exists,
                vec![Bind::Text(format!("\"{schema}\".\"{name}\""))],
            )
            .await
            .map_err(m)?
            .unwrap_or(0);
        if exists > 0 {
            continue;
        }
        conn.execute(probe, Vec::new()).await.map_err(m)?;
        let probe_name = probe
            .split('"')
            .nth(1)
            .expect("the probe index is named in quotes");
        let same = conn
            .inbox_int8(
                &s.equivalent,
                vec![
                    Bind::Text(table.dotted()),
                    Bind::Text(format!("pg_temp.\"{probe_name}\"")),
                ],
            )
            .await
            .map_err(m)?
            .unwrap_or(0);
        if same == 0 {
            conn.execute(create, Vec::new()).await.map_err(m)?;
        }
    }
    Ok(())
}

/// Creates the inbox schema of `table` in `layout` in a transaction of its own.
pub async fn create_inbox_schema_with<D: Driver>(
    driver: &D,
    table: &TableName,
    layout: Layout,
) -> Result<(), RepositoryError>
where
    D::Conn: InboxRows,
{
    let mut tx = driver.begin(table).await?;
    let r = create_inbox_schema_on(&mut *tx, table, layout).await;
    crate::driver::finish::<D, ()>(table, tx, r).await
}
