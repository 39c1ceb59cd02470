//! `outbox-relay`: runs the outbox relay against PostgreSQL and a broker, and the operator's
//! commands on the outbox table and (`outbox-relay inbox …`) on an inbox table.
//!
//! ```sh
//! cargo run -p txoutbox-examples --bin outbox-relay -- --help
//! cargo run -p txoutbox-examples --bin outbox-relay -- migrate --database-url postgres://postgres@127.0.0.1:5432/test
//! cargo run -p txoutbox-examples --bin outbox-relay -- run --broker nats --until-drained
//! ```
//!
//! Every flag also reads the environment variable named in `--help`; `--help` never shows the
//! values of those variables (they may hold passwords). The exit codes are in `--help` and in
//! `examples/README.md`.

// The doc comments of the flags are clap's help text, plain text for a terminal (`[:password]`
// is not a link there); rustdoc need not resolve them.
#![allow(rustdoc::broken_intra_doc_links)]

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use txoutbox_postgres::{Pooler, TableName};
use uuid::Uuid;

mod broker;
mod broker_kr;
mod duration;
mod error;
mod inbox;
mod ops;
mod run;
mod store;

use error::{CliError, EXIT_CODES_HELP};
use store::StoreKind;

#[derive(Debug, Parser)]
#[command(
    name = "outbox-relay",
    version,
    about = "Transactional outbox relay and operator commands for PostgreSQL",
    after_help = EXIT_CODES_HELP
)]
struct Cli {
    /// Logs as JSON lines (on stderr). The level comes from RUST_LOG (default `info`).
    #[arg(long, global = true, env = "OUTBOX_LOG_JSON")]
    log_json: bool,
    #[command(subcommand)]
    command: Command,
}

/// The database and the store, shared by the outbox and the inbox commands.
#[derive(Debug, Clone, Args)]
pub struct ConnArgs {
    /// PostgreSQL URL, e.g. postgres://user[:password]@host[:port]/database (required by
    /// every command that connects; `migrate --print-sql` does not).
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "",
        hide_default_value = true
    )]
    pub database_url: String,
    /// The backend crate that runs the queries: sqlx (outbox-postgres) or diesel (outbox-diesel,
    /// cargo feature `diesel`). Both use the same table.
    #[arg(long, env = "OUTBOX_STORE", value_enum, default_value_t = StoreKind::Sqlx)]
    pub store: StoreKind,
    /// How --database-url reaches PostgreSQL: `none` (directly, or a session-pooling proxy) or
    /// `transaction` (a transaction-pooling proxy such as PgBouncer `pool_mode = transaction`:
    /// no statement is prepared beyond its transaction, every statement runs in one). `migrate`
    /// needs a direct URL; LISTEN needs one too (--listen-url).
    #[arg(long, env = "OUTBOX_POOLER", default_value = "none", value_parser = parse_pooler)]
    pub pooler: Pooler,
    /// The URL the wake-up listener LISTENs on (default --database-url). Notifications do not
    /// pass a transaction-pooling proxy: with `--pooler transaction`, give PostgreSQL's own
    /// address here.
    #[arg(long, env = "OUTBOX_LISTEN_URL")]
    pub listen_url: Option<String>,
}

impl ConnArgs {
    /// Refuses (usage error) a schema creation through a transaction-pooling proxy.
    pub fn require_direct(&self, what: &str) -> error::Result<()> {
        if self.pooler == Pooler::Transaction {
            return Err(error::CliError::usage(format!(
                "{what} creates the schema under a session-level lock and setting, which a transaction-pooling proxy does not keep: run it with a direct --database-url (PostgreSQL itself, not the proxy) and without --pooler transaction"
            )));
        }
        Ok(())
    }
}

fn parse_pooler(s: &str) -> Result<Pooler, String> {
    s.parse()
}

/// Where the outbox table is.
#[derive(Debug, Clone, Args)]
pub struct DbArgs {
    #[command(flatten)]
    pub conn: ConnArgs,
    /// The outbox table, `table` or `schema.table` (lowercase letters, digits and `_`).
    #[arg(long, env = "OUTBOX_TABLE", default_value = "outbox_events", value_parser = parse_table)]
    pub table: TableName,
}

fn parse_table(s: &str) -> Result<TableName, String> {
    TableName::new(s).map_err(|e| e.to_string())
}

fn parse_dur(s: &str) -> Result<Duration, String> {
    duration::parse(s)
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Runs the relay: fetches due rows, publishes them in order per key, records the outcomes.
    ///
    /// Wakes on LISTEN/NOTIFY (channel `outbox.<table>`, see the writers' `notify` helper) and
    /// polls otherwise. SIGINT/SIGTERM finish the cycle in flight, release what was not
    /// published and exit 0.
    Run(Box<run::RunArgs>),
    /// Creates the outbox table and its indexes (idempotent; adds only what is missing).
    Migrate {
        #[command(flatten)]
        db: DbArgs,
        /// The partitioned layout: `PARTITION BY RANGE (created_at)` with a default partition and
        /// monthly partitions (UTC) from this month through --months-ahead more. Run it again
        /// regularly (daily) to add the coming months; it changes nothing else. Writers must use
        /// the partitioned layout too (`PgOutboxWriter::with_layout`,
        /// `DieselOutboxWriter::with_layout`). An existing plain table is refused (exit 1).
        #[arg(long)]
        partitioned: bool,
        /// With --partitioned: how many months after the current one get a partition (0 to 120).
        #[arg(long, default_value_t = txoutbox_postgres::sql::partitioned::DEFAULT_MONTHS_AHEAD,
              requires = "partitioned")]
        months_ahead: u32,
        /// Prints the DDL instead of running it, and connects to nothing: the exact statements
        /// `migrate` runs for this --table and layout (schema, table, indexes; with
        /// --partitioned the default partition and the monthly partitions from the month the
        /// script runs in). Every statement is idempotent. Save it as a sqlx migration, e.g.
        /// `outbox-relay migrate --print-sql > migrations/20260101000000_outbox.sql`.
        #[arg(long)]
        print_sql: bool,
    },
    /// Row counts per topic and status, blocked keys, and the age of the oldest due row.
    Stats {
        #[command(flatten)]
        db: DbArgs,
        /// Prints JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// The lease TTL the relays use (a lock older than this is not "held").
        #[arg(long, env = "OUTBOX_LEASE", default_value = "300s", value_parser = parse_dur)]
        lease: Duration,
    },
    /// Keys whose first row waits for a retry or is held under a live lease, oldest first.
    BlockedKeys {
        #[command(flatten)]
        db: DbArgs,
        /// Prints JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// At most this many keys.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..))]
        limit: u32,
        /// The lease TTL the relays use.
        #[arg(long, env = "OUTBOX_LEASE", default_value = "300s", value_parser = parse_dur)]
        lease: Duration,
    },
    /// Moves failed rows back to pending (attempts 0, due now): one id, or all failed rows of a
    /// topic and/or partition key.
    #[command(group(clap::ArgGroup::new("which").required(true).multiple(true).args(["id", "topic", "key"])))]
    RequeueFailed {
        #[command(flatten)]
        db: DbArgs,
        /// The row id.
        #[arg(conflicts_with_all = ["topic", "key"])]
        id: Option<Uuid>,
        /// All failed rows of this topic.
        #[arg(long)]
        topic: Option<String>,
        /// All failed rows of this partition key.
        #[arg(long)]
        key: Option<String>,
        /// Prints JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Redrives parked rows (pending with every attempt spent, kept by `run --on-exhausted
    /// park`): each is due now with no attempts, ahead of its key's later rows, so the key
    /// resumes in write order. One id, every parked row of --topic and --key, or of --topic.
    /// Any other row is refused with its state (exit 1, nothing changed).
    #[command(group(clap::ArgGroup::new("which").required(true).multiple(true).args(["id", "topic"])))]
    Redrive {
        #[command(flatten)]
        db: DbArgs,
        #[command(flatten)]
        rows: ParkedArgs,
        /// Prints JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Discards parked rows: each becomes failed with last error `discarded: <reason>; ` and
    /// its old error, and its key goes on without it. Rows as `redrive`.
    #[command(group(clap::ArgGroup::new("which").required(true).multiple(true).args(["id", "topic"])))]
    Discard {
        #[command(flatten)]
        db: DbArgs,
        #[command(flatten)]
        rows: ParkedArgs,
        /// Why (1 to 255 characters after trimming).
        #[arg(long)]
        reason: String,
        /// Prints JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Releases pending rows locked longer ago than --older-than (relays that died).
    ReleaseStaleLocks {
        #[command(flatten)]
        db: DbArgs,
        /// Lock age, at least 1s (e.g. 10m).
        #[arg(long, value_parser = parse_dur)]
        older_than: Duration,
        /// Prints JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Deletes completed rows completed longer ago than --older-than (whole days, at least 1d).
    Cleanup {
        #[command(flatten)]
        db: DbArgs,
        /// Retention in whole days, e.g. 7d.
        #[arg(long, value_parser = parse_dur)]
        older_than: Duration,
        /// Rows deleted per statement (1 to 10,000).
        #[arg(long, default_value_t = 1000)]
        batch_size: usize,
        /// Prints JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Releases a held row whoever holds it and records the reason as its last error.
    ForceUnlock {
        #[command(flatten)]
        db: DbArgs,
        /// The row id.
        id: Uuid,
        /// Why (1 to 255 characters after trimming); stored as `Force unlock: <reason>`.
        #[arg(long)]
        reason: String,
        /// Prints JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// The operator commands on an inbox table: stats and blocked-keys of one consumer group,
    /// requeue-failed and force-unlock of one row, release-stale-locks and cleanup across every
    /// group (`outbox-relay inbox <command> --help`).
    #[command(subcommand, after_help = EXIT_CODES_HELP)]
    Inbox(inbox::InboxCommand),
}

/// The parked rows `redrive` and `discard` act on (R192).
#[derive(Debug, Clone, clap::Args)]
pub struct ParkedArgs {
    /// The row id.
    #[arg(conflicts_with_all = ["topic", "key"])]
    pub id: Option<Uuid>,
    /// Every parked row of this topic (with --key: of that key only).
    #[arg(long)]
    pub topic: Option<String>,
    /// With --topic: every parked row of this partition key.
    #[arg(long, requires = "topic")]
    pub key: Option<String>,
}

/// Which broker `run` publishes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BrokerKind {
    /// NATS JetStream (cargo feature `nats`, on by default).
    Nats,
    /// Redis Streams (cargo feature `redis`).
    Redis,
    /// Kafka (cargo feature `kafka`).
    Kafka,
    /// RabbitMQ (cargo feature `rabbitmq`).
    Rabbitmq,
    /// One JSON line per event on stdout (always compiled in).
    Stdout,
    /// Acknowledges everything and sends nothing: every event is marked completed and lost
    /// (always compiled in; for benchmarks only, and only when named).
    Noop,
}

fn init_tracing(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    if json {
        b.json().init();
    } else {
        b.init();
    }
}

async fn dispatch(cmd: Command) -> Result<(), CliError> {
    match cmd {
        Command::Run(a) => run::run(*a).await,
        Command::Migrate {
            db,
            partitioned,
            months_ahead,
            print_sql,
        } => {
            if print_sql {
                ops::print_sql(&db, partitioned, months_ahead)
            } else {
                ops::migrate(&db, partitioned, months_ahead).await
            }
        }
        Command::Stats { db, json, lease } => ops::stats(&db, json, lease).await,
        Command::BlockedKeys {
            db,
            json,
            limit,
            lease,
        } => ops::blocked_keys(&db, json, limit as usize, lease).await,
        Command::RequeueFailed {
            db,
            id,
            topic,
            key,
            json,
        } => ops::requeue_failed(&db, id, topic, key, json).await,
        Command::Redrive { db, rows, json } => {
            ops::redrive(&db, rows.id, rows.topic, rows.key, json).await
        }
        Command::Discard {
            db,
            rows,
            reason,
            json,
        } => ops::discard(&db, rows.id, rows.topic, rows.key, &reason, json).await,
        Command::ReleaseStaleLocks {
            db,
            older_than,
            json,
        } => ops::release_stale_locks(&db, older_than, json).await,
        Command::Cleanup {
            db,
            older_than,
            batch_size,
            json,
        } => ops::cleanup(&db, older_than, batch_size, json).await,
        Command::ForceUnlock {
            db,
            id,
            reason,
            json,
        } => ops::force_unlock(&db, id, &reason, json).await,
        Command::Inbox(cmd) => inbox::dispatch(cmd).await,
    }
}

/// The command line, with `hide_env_values` on every argument that reads the environment, in
/// every subcommand: `--help` names the variables and never prints their values (a
/// `DATABASE_URL` holds a password).
fn command() -> clap::Command {
    fn hide(cmd: clap::Command) -> clap::Command {
        cmd.mut_args(|a| {
            if a.get_env().is_some() {
                a.hide_env_values(true)
            } else {
                a
            }
        })
        .mut_subcommands(hide)
    }
    hide(Cli::command())
}

fn main() -> ExitCode {
    let cli = match Cli::from_arg_matches(&command().get_matches()) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    init_tracing(cli.log_json);
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: could not start the async runtime: {e}");
            return ExitCode::from(error::code::OTHER as u8);
        }
    };
    match rt.block_on(dispatch(cli.command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", e.message);
            ExitCode::from(e.code as u8)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every argument that reads the environment hides its value in `--help`, in every
    /// subcommand.
    #[test]
    fn no_argument_shows_its_environment_value_in_help() {
        fn walk(cmd: &clap::Command, seen: &mut usize) {
            for a in cmd.get_arguments() {
                if a.get_env().is_some() {
                    *seen += 1;
                    assert!(
                        a.is_hide_env_values_set(),
                        "{} --{} shows its env value",
                        cmd.get_name(),
                        a.get_id()
                    );
                }
            }
            for s in cmd.get_subcommands() {
                walk(s, seen);
            }
        }
        let mut seen = 0;
        walk(&command(), &mut seen);
        assert!(seen > 20, "only {seen} arguments read the environment");
    }
}
