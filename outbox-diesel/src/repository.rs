//! The repository (relay and operator side): the one repository of `txoutbox_postgres::outbox`
//! over [`DieselDriver`], a deadpool pool of diesel-async connections.

use txoutbox_postgres::outbox::Repository;

use crate::driver::DieselDriver;

/// Settings of the diesel backend: the one settings type of both PostgreSQL backends.
pub type DieselConfig = txoutbox_postgres::PgConfig;

/// The diesel-async repository on a deadpool pool: `DieselOutboxRepository::new(pool,
/// DieselConfig::default())`. Cloning shares the pool. Run the migrations first
/// ([`crate::run_migrations`]). Its pool is `repo.driver().pool()`.
pub type DieselOutboxRepository = Repository<DieselDriver>;
