//! The deadpool pool of diesel-async connections (tokio-postgres underneath: no libpq).

use std::time::Duration;

use diesel_async::AsyncPgConnection;
use diesel_async::SimpleAsyncConnection;
use diesel_async::pooled_connection::deadpool::{Object, Pool};
use diesel_async::pooled_connection::{
    AsyncDieselConnectionManager, ManagerConfig, RecyclingMethod,
};
use futures::FutureExt;

use crate::error::Error;

/// A pool of diesel-async PostgreSQL connections.
pub type PgPool = Pool<AsyncPgConnection>;

/// A connection taken from a [`PgPool`]; it derefs to [`AsyncPgConnection`].
pub type PooledConnection = Object<AsyncPgConnection>;

/// The largest pool [`PoolSettings::max_size`] accepts (the pool reserves room for this many
/// connections up front, so a larger number could not even be allocated).
pub const MAX_POOL_SIZE: usize = 10_000;

/// Settings of the pool [`build_pool`] makes.
#[derive(Debug, Clone)]
pub struct PoolSettings {
    max_size: usize,
    wait_timeout: Duration,
    create_timeout: Duration,
}

impl Default for PoolSettings {
    fn default() -> Self {
        Self {
            max_size: 16,
            wait_timeout: Duration::from_secs(30),
            create_timeout: Duration::from_secs(10),
        }
    }
}

impl PoolSettings {
    /// At most this many connections (default 16, 1 to [`MAX_POOL_SIZE`]).
    pub fn max_size(mut self, n: usize) -> Result<Self, Error> {
        if n == 0 {
            return Err(Error::Config(
                "pool max_size must be at least 1, got 0".into(),
            ));
        }
        if n > MAX_POOL_SIZE {
            return Err(Error::Config(format!(
                "pool max_size must be at most {MAX_POOL_SIZE} (a PostgreSQL server serves far fewer connections), got {n}"
            )));
        }
        self.max_size = n;
        Ok(self)
    }

    /// How long a caller waits for a free connection before the operation fails as unavailable
    /// (default 30 s).
    pub fn wait_timeout(mut self, d: Duration) -> Self {
        self.wait_timeout = d;
        self
    }

    /// How long opening a new connection may take (default 10 s).
    pub fn create_timeout(mut self, d: Duration) -> Self {
        self.create_timeout = d;
        self
    }
}

/// Connects with [`crate::tls::establish`]. diesel-async's connection setup runs two session
/// settings (time zone, client encoding) as prepared statements outside a transaction; through
/// a transaction-pooling proxy (R194) the halves of one can reach two server connections and
/// fail with "prepared statement … does not exist". Such a setup is tried again, up to 5 times
/// (the proxy keeps both settings per client: PgBouncer tracks TimeZone and client_encoding).
async fn establish_retrying(
    url: String,
) -> diesel::ConnectionResult<diesel_async::AsyncPgConnection> {
    let mut tries = 1;
    loop {
        match crate::tls::establish(&url).await {
            Err(diesel::ConnectionError::CouldntSetupConfiguration(e))
                if tries < 5 && e.to_string().contains("prepared statement") =>
            {
                tries += 1;
            }
            r => return r,
        }
    }
}

/// Builds a pool for `database_url` (`postgres://user@host:port/db`). No connection is opened
/// until one is needed; an unreachable database shows as [`txoutbox_core::RepositoryError::Unavailable`]
/// on first use.
///
/// TLS: `sslmode=require`, `verify-ca` or `verify-full` in the URL (with `sslrootcert=` for a
/// CA outside the system store) connects over rustls, with the cargo feature `tls`; see
/// [`crate::tls`]. A bad TLS parameter or CA file fails here, with [`Error::Config`].
pub fn build_pool(database_url: &str, settings: &PoolSettings) -> Result<PgPool, Error> {
    let _tls = crate::tls::parse_url(database_url)?;
    #[cfg(feature = "tls")]
    if let Some(t) = &_tls.tls {
        crate::tls::client_config(t)?;
    }
    #[cfg(not(feature = "tls"))]
    if _tls.tls.is_some() {
        return Err(Error::Config(
            "the database URL asks for TLS (sslmode=require/verify-ca/verify-full), and outbox-diesel was built without its `tls` feature; enable it (rustls, no OpenSSL)".into(),
        ));
    }
    let mut config = ManagerConfig::default();
    config.custom_setup = Box::new(|url| establish_retrying(url.to_owned()).boxed());
    // The check before a pooled connection is handed out: `SELECT 1` on the simple protocol.
    // diesel-async's default (`Verified`) prepares and caches a statement outside any
    // transaction, which a transaction-pooling proxy (R194) leaves on one server connection,
    // where it collides with another client's statement of the same name.
    config.recycling_method = RecyclingMethod::CustomFunction(Box::new(|c| {
        Box::pin(async move { c.batch_execute("SELECT 1").await })
    }));
    let manager =
        AsyncDieselConnectionManager::<AsyncPgConnection>::new_with_config(database_url, config);
    Pool::builder(manager)
        .max_size(settings.max_size)
        .wait_timeout(Some(settings.wait_timeout))
        .create_timeout(Some(settings.create_timeout))
        .recycle_timeout(Some(settings.create_timeout))
        .runtime(deadpool::Runtime::Tokio1)
        .build()
        .map_err(|e| Error::Pool(e.to_string()))
}
