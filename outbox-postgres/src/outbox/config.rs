//! The settings of a repository, the same for every driver.

use txoutbox_core::repository::{DEFAULT_BACKEND_BATCH_SIZE, check_backend_batch_size};

use crate::error::Error;
use crate::sql::{Layout, Pooler, TableName};

/// Settings of a PostgreSQL repository (sqlx or diesel: one type, `DieselConfig` is this).
#[derive(Debug, Clone)]
pub struct PgConfig {
    pub(crate) table: TableName,
    pub(crate) layout: Layout,
    pub(crate) batch_size: usize,
    pub(crate) error_max_length: usize,
    pub(crate) pooler: Pooler,
}

impl Default for PgConfig {
    fn default() -> Self {
        Self {
            table: TableName::default(),
            layout: Layout::Plain,
            batch_size: DEFAULT_BACKEND_BATCH_SIZE,
            error_max_length: txoutbox_core::event::limits::DEFAULT_ERROR_MAX_LENGTH,
            pooler: Pooler::None,
        }
    }
}

impl PgConfig {
    /// The table name, `table` or `schema.table`, validated (R78).
    pub fn table_name(mut self, name: &str) -> Result<Self, Error> {
        self.table = TableName::new(name)?;
        Ok(self)
    }

    /// An already validated table name.
    pub fn table(mut self, table: TableName) -> Self {
        self.table = table;
        self
    }

    /// The table's layout (default [`Layout::Plain`]); it must match how the table was created
    /// (`create_schema_with`, or the diesel migrations). The repository's writer writes with it.
    pub fn layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self
    }

    /// The configured layout.
    pub fn layout_ref(&self) -> Layout {
        self.layout
    }

    /// Maintenance batch size (R63): 1 to 10,000, default 1000.
    pub fn batch_size(mut self, n: usize) -> Result<Self, txoutbox_core::ConfigError> {
        self.batch_size = check_backend_batch_size(n)?;
        Ok(self)
    }

    /// last_error limit in bytes (R9): 16 to 2,000 (the size of the `last_error` column), default
    /// 2,000; a larger value is a configuration error.
    pub fn error_max_length(mut self, n: usize) -> Result<Self, txoutbox_core::ConfigError> {
        self.error_max_length = txoutbox_core::event::check_error_max_length(n)?;
        Ok(self)
    }

    /// How the pool reaches PostgreSQL (R194, default [`Pooler::None`]): with
    /// [`Pooler::Transaction`] (a transaction-pooling proxy such as PgBouncer's
    /// `pool_mode = transaction` in front) no statement is prepared beyond its transaction and
    /// every statement runs inside one; the repository's writer writes the same way. LISTEN
    /// (`WakeListener`, R195) and creating the schema need a direct URL.
    pub fn pooler(mut self, pooler: Pooler) -> Self {
        self.pooler = pooler;
        self
    }

    /// The configured pooler mode.
    pub fn pooler_ref(&self) -> Pooler {
        self.pooler
    }

    /// The configured table.
    pub fn table_ref(&self) -> &TableName {
        &self.table
    }
}
