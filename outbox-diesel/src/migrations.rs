//! Creating the schema: the DDL shared with `outbox-postgres`, run through diesel_migrations.
//!
//! # Why no `migrations/` folder
//!
//! The table name is configurable (R78), and a static `up.sql` could only create one fixed
//! name; a second copy of the DDL would also be the SQL written twice. So the one migration of
//! this crate, [`OutboxMigrations`], is a diesel [`MigrationSource`] built at run time from
//! `txoutbox_postgres::sql::ddl(table)`: the same statements the sqlx backend's `create_schema`
//! runs, for any validated table name. It is embedded in the binary like `embed_migrations!`
//! output, and diesel_migrations records it in `__diesel_schema_migrations` as version
//! `outbox_<table>_0001`, so it runs once per table. A second migration, `outbox_<table>_0002`,
//! creates the additive indexes (`txoutbox_postgres::sql::additions`) with `CREATE INDEX IF NOT
//! EXISTS`: a table migrated before they existed gets them, a new one finds them made by
//! `0001`; `outbox_<table>_0003` runs them again for the parked-row index (R193) added later. For a large existing table, build them first with
//! `txoutbox_postgres::sql::create_indexes_concurrently` (outside a transaction).
//!
//! # The partitioned layout
//!
//! [`OutboxMigrations::with_layout`] with [`Layout::Partitioned`] runs
//! `txoutbox_postgres::sql::partitioned::ddl` instead (the table `PARTITION BY RANGE
//! (created_at)`, its default partition, the seven indexes and the additions, and the monthly
//! partitions of the current month and the next three), recorded as version
//! `outbox_<table>_p0001` (and `_p0002` for the additions) so the two
//! layouts' migrations are never taken for one another; over an existing plain table it fails
//! and changes nothing. Later months come from [`ensure_partitions`], a maintenance call to run
//! regularly (not a migration: it depends on the date).
//!
//! # Where the bookkeeping lives
//!
//! [`run_migrations`] puts `__diesel_schema_migrations` in the outbox table's own schema (for
//! `ops.outbox_events`: `ops`; for an unqualified name: the first schema of the connection's
//! `search_path`), so each schema records its own outbox tables and creators of different
//! schemas never race on one bookkeeping table.
//!
//! # No libpq
//!
//! diesel_migrations is synchronous; diesel-async's [`AsyncMigrationHarness`] runs it over the
//! async connection (tokio-postgres) with `tokio::task::block_in_place`, which panics on a
//! current-thread runtime: call [`run_migrations`] from a multi-thread runtime
//! (`#[tokio::main]`, `#[tokio::test(flavor = "multi_thread")]`).

use std::fmt;

use diesel::migration::{
    Migration, MigrationMetadata, MigrationName, MigrationSource, MigrationVersion,
};
use diesel::pg::Pg;
use diesel::query_builder::SqlQuery;
use diesel::sql_types::Text;
use diesel::{QueryableByName, connection::BoxableConnection};
use diesel_async::{
    AsyncConnection, AsyncMigrationHarness, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection,
};
use diesel_migrations::MigrationHarness;
use txoutbox_postgres::sql::{self, Layout, Statements, TableName};

use crate::error::Error;

/// The outbox schema as a diesel migration source: one migration per table that runs
/// `txoutbox_postgres::sql::ddl(table)` in a transaction, under the shared schema advisory lock.
/// Use it with any diesel [`MigrationHarness`], or call [`run_migrations`].
#[derive(Debug, Clone)]
pub struct OutboxMigrations {
    table: TableName,
    layout: Layout,
}

impl OutboxMigrations {
    /// The migrations for `table` (plain layout).
    pub fn new(table: &TableName) -> Self {
        Self::with_layout(table, Layout::Plain)
    }

    /// The migrations for `table` in `layout`.
    pub fn with_layout(table: &TableName, layout: Layout) -> Self {
        Self {
            table: table.clone(),
            layout,
        }
    }

    /// The version recorded in `__diesel_schema_migrations`: `outbox_<table>_0001` for the
    /// plain layout, `outbox_<table>_p0001` for the partitioned one (at most 44 characters,
    /// within diesel's 50).
    pub fn version(&self) -> String {
        match self.layout {
            Layout::Plain => format!("outbox_{}_0001", self.table.table()),
            Layout::Partitioned => format!("outbox_{}_p0001", self.table.table()),
        }
    }

    /// The version of the second migration, which creates the additive indexes:
    /// `outbox_<table>_0002` (plain) or `outbox_<table>_p0002` (partitioned).
    pub fn additions_version(&self) -> String {
        match self.layout {
            Layout::Plain => format!("outbox_{}_0002", self.table.table()),
            Layout::Partitioned => format!("outbox_{}_p0002", self.table.table()),
        }
    }

    /// The version of the third migration, which adds the parked-row index (R193) to a table
    /// migrated before it existed: `outbox_<table>_0003` (plain) or `outbox_<table>_p0003`.
    /// It runs the additions again (`IF NOT EXISTS`: only the missing ones are built).
    pub fn parked_version(&self) -> String {
        match self.layout {
            Layout::Plain => format!("outbox_{}_0003", self.table.table()),
            Layout::Partitioned => format!("outbox_{}_p0003", self.table.table()),
        }
    }

    /// The SQL the migration runs, as one script: the advisory lock, then the DDL.
    pub fn up_sql(&self) -> String {
        self.locked(match self.layout {
            Layout::Plain => sql::ddl(&self.table),
            Layout::Partitioned => {
                sql::partitioned::ddl(&self.table, sql::partitioned::DEFAULT_MONTHS_AHEAD)
            }
        })
    }

    /// The SQL of the second migration: the advisory lock, then `CREATE INDEX IF NOT EXISTS`
    /// for each of `txoutbox_postgres::sql::additions` (on the parent, for the partitioned
    /// layout).
    pub fn additions_sql(&self) -> String {
        self.locked(sql::create_additions(&self.table))
    }

    /// `statements` after the schema advisory lock, as one script.
    fn locked(&self, statements: Vec<String>) -> String {
        let stmts = Statements::new(&self.table);
        // The shared statement binds the lock key as `$1`, but a diesel migration only gets a
        // `BoxableConnection`, which runs SQL text without binds. The key is
        // `outbox-schema:` + the validated table name (only [a-z0-9_.:-]), so it is written
        // here as a literal; the statement is otherwise the shared one.
        let lock = stmts
            .schema_lock
            .replace("$1", &format!("'{}'", stmts.schema_lock_key()));
        let mut script = vec![lock];
        script.extend(statements);
        script.join(";\n") + ";\n"
    }
}

struct SchemaMigration {
    name: OutboxMigrationName,
    up: String,
}

#[derive(Debug, Clone)]
struct OutboxMigrationName {
    version: String,
    what: &'static str,
    table: String,
}

impl fmt::Display for OutboxMigrationName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}_{}_{}", self.version, self.what, self.table)
    }
}

impl MigrationName for OutboxMigrationName {
    fn version(&self) -> MigrationVersion<'_> {
        MigrationVersion::from(self.version.as_str())
    }
}

struct InTransaction;

impl MigrationMetadata for InTransaction {
    fn run_in_transaction(&self) -> bool {
        true
    }
}

impl Migration<Pg> for SchemaMigration {
    fn run(&self, conn: &mut dyn BoxableConnection<Pg>) -> diesel::migration::Result<()> {
        conn.batch_execute(&self.up)?;
        Ok(())
    }

    fn revert(&self, _conn: &mut dyn BoxableConnection<Pg>) -> diesel::migration::Result<()> {
        Err("the outbox table is never dropped by a migration: its rows are the undelivered events; drop it by hand if you mean to".into())
    }

    fn metadata(&self) -> &dyn MigrationMetadata {
        &InTransaction
    }

    fn name(&self) -> &dyn MigrationName {
        &self.name
    }
}

impl MigrationSource<Pg> for OutboxMigrations {
    fn migrations(&self) -> diesel::migration::Result<Vec<Box<dyn Migration<Pg>>>> {
        let migration = |version, what, up| -> Box<dyn Migration<Pg>> {
            Box::new(SchemaMigration {
                name: OutboxMigrationName {
                    version,
                    what,
                    table: self.table.dotted(),
                },
                up,
            })
        };
        Ok(vec![
            migration(self.version(), "create_outbox_table", self.up_sql()),
            migration(
                self.additions_version(),
                "add_outbox_indexes",
                self.additions_sql(),
            ),
            migration(
                self.parked_version(),
                "add_outbox_parked_index",
                self.additions_sql(),
            ),
        ])
    }
}

#[derive(QueryableByName)]
struct SearchPath {
    #[diesel(sql_type = Text)]
    search_path: String,
}

fn ident(s: &str) -> String {
    // Only validated identifiers reach here (TableName), so quoting cannot be escaped.
    format!("\"{s}\"")
}

/// Runs the pending outbox migrations for `table` on `conn` (see the module docs), and returns
/// the connection. Idempotent: the migration runs once per table; its DDL also only adds what
/// is missing (R79), so running it over a table the sqlx backend or the ancestor created is
/// safe. Needs a multi-thread tokio runtime.
pub async fn run_migrations(
    conn: AsyncPgConnection,
    table: &TableName,
) -> Result<AsyncPgConnection, Error> {
    run_migrations_with(conn, table, Layout::Plain).await
}

/// [`run_migrations`] for either layout ([`OutboxMigrations::with_layout`]).
pub async fn run_migrations_with(
    mut conn: AsyncPgConnection,
    table: &TableName,
    layout: Layout,
) -> Result<AsyncPgConnection, Error> {
    let fail = |message: String| Error::Migration {
        table: table.dotted(),
        message,
    };
    let saved = match table.schema() {
        Some(schema) => {
            let before: SearchPath =
                diesel::sql_query("SELECT current_setting('search_path') AS search_path")
                    .get_result(&mut conn)
                    .await
                    .map_err(|e| fail(e.to_string()))?;
            conn.batch_execute(&format!(
                "CREATE SCHEMA IF NOT EXISTS {s}; SET search_path TO {s}",
                s = ident(schema)
            ))
            .await
            .map_err(|e| fail(e.to_string()))?;
            Some(before.search_path)
        }
        None => None,
    };
    let mut harness = AsyncMigrationHarness::new(conn);
    let ran = harness
        .run_pending_migrations(OutboxMigrations::with_layout(table, layout))
        .map(|_| ())
        .map_err(|e| fail(e.to_string()));
    let mut conn = harness.into_inner();
    if let Some(path) = saved {
        let restore: SqlQuery =
            diesel::sql_query("SELECT set_config('search_path', $1, false) AS search_path");
        let _: SearchPath = restore
            .bind::<Text, _>(path)
            .get_result(&mut conn)
            .await
            .map_err(|e| fail(format!("could not restore search_path: {e}")))?;
    }
    ran?;
    Ok(conn)
}

/// Opens a connection to `database_url`, runs [`run_migrations`] and closes it.
pub async fn run_migrations_url(database_url: &str, table: &TableName) -> Result<(), Error> {
    let conn = AsyncPgConnection::establish(database_url)
        .await
        .map_err(|e| Error::Migration {
            table: table.dotted(),
            message: format!("could not connect: {e}"),
        })?;
    run_migrations(conn, table).await.map(drop)
}

/// Runs the shared DDL for `table` directly, without migration bookkeeping, in one
/// transaction under the schema advisory lock: exactly what the sqlx backend's `create_schema`
/// does. Use it when the application tracks migrations elsewhere; it is idempotent and on an
/// existing table adds only what is missing (R79). Works on a current-thread runtime.
pub async fn create_schema(conn: &mut AsyncPgConnection, table: &TableName) -> Result<(), Error> {
    create_schema_with(conn, table, Layout::Plain).await
}

/// [`create_schema`] for either layout.
pub async fn create_schema_with(
    conn: &mut AsyncPgConnection,
    table: &TableName,
    layout: Layout,
) -> Result<(), Error> {
    let script = OutboxMigrations::with_layout(table, layout).up_sql();
    conn.transaction(async |c| c.batch_execute(&script).await)
        .await
        .map_err(|e: diesel::result::Error| Error::Migration {
            table: table.dotted(),
            message: e.to_string(),
        })
}

/// Partitioned layout: creates the missing monthly partitions from the current month (database
/// clock, UTC months) through `months_ahead` months ahead (at most
/// `txoutbox_postgres::sql::partitioned::MONTHS_AHEAD_MAX`), in one transaction under the schema
/// advisory lock, like the sqlx backend's `ensure_partitions`. Run it regularly (daily, say).
/// Fails with [`Error::Partitions`], creating nothing, when the default partition already
/// holds rows of a missing month (the message says what to do). Works on a current-thread
/// runtime.
pub async fn ensure_partitions(
    conn: &mut AsyncPgConnection,
    table: &TableName,
    months_ahead: u32,
) -> Result<(), Error> {
    let n = sql::partitioned::check_months_ahead(months_ahead)?;
    let stmts = Statements::new(table);
    let lock = stmts
        .schema_lock
        .replace("$1", &format!("'{}'", stmts.schema_lock_key()));
    let script = format!(
        "{lock};\n{};\n",
        sql::partitioned::ensure_partitions(table, n)
    );
    conn.transaction(async |c| c.batch_execute(&script).await)
        .await
        .map_err(|e: diesel::result::Error| Error::Partitions {
            table: table.dotted(),
            message: e.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_differ_per_layout_and_fit_diesel() {
        let t = TableName::new(&"t".repeat(31)).unwrap();
        let plain = OutboxMigrations::new(&t).version();
        let part = OutboxMigrations::with_layout(&t, Layout::Partitioned).version();
        assert_ne!(plain, part);
        assert!(part.len() <= 50 && plain.len() <= 50, "{part}");
        let m = OutboxMigrations::with_layout(&t, Layout::Partitioned);
        assert!(m.additions_version().len() <= 50 && m.additions_version() != part);
        assert!(m.additions_sql().contains("_pending_window"));
        assert!(
            OutboxMigrations::with_layout(&t, Layout::Partitioned)
                .up_sql()
                .contains("PARTITION BY RANGE (created_at)")
        );
        assert!(!OutboxMigrations::new(&t).up_sql().contains("PARTITION"));
    }
}
