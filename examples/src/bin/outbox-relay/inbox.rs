//! `outbox-relay inbox <command>`: the operator's commands on an inbox table (R198), the
//! outbox commands' counterparts. Every query is the library's: the inbox repository of the
//! chosen store ([`crate::store::open_inbox`]); the flags, the output (`--json`), the argument
//! checks, the refusals and the exit codes are the outbox commands' ([`crate::ops`]).

use std::time::Duration;

use clap::{Args, Subcommand};
use txoutbox_core::inbox::ConsumerGroup;
use txoutbox_core::repository::DEFAULT_CLEANUP_MAX_ITERATIONS;
use uuid::Uuid;

use crate::error::{CliError, Result, TableRole};
use crate::ops::{
    self, BlockedRow, DeletedOut, ReleasedOut, RequeuedOut, Totals, UnlockedOut, report,
};
use crate::store::{self, InboxStore};
use crate::{ConnArgs, parse_dur};
use txoutbox_postgres::TableName;

/// Where the inbox table is.
#[derive(Debug, Clone, Args)]
pub struct InboxDbArgs {
    #[command(flatten)]
    pub conn: ConnArgs,
    /// The inbox table, `table` or `schema.table` (lowercase letters, digits and `_`), plain or
    /// partitioned (the layout is read from the database).
    #[arg(long, env = "INBOX_TABLE", default_value = "inbox_events", value_parser = parse_inbox_table)]
    pub table: TableName,
}

/// The outbox's table-name rules; the message names the inbox table.
fn parse_inbox_table(s: &str) -> std::result::Result<TableName, String> {
    TableName::new(s).map_err(|e| {
        e.to_string()
            .replacen("invalid outbox table name", "invalid inbox table name", 1)
    })
}

fn parse_group(s: &str) -> std::result::Result<ConsumerGroup, String> {
    ConsumerGroup::new(s).map_err(|e| format!("invalid consumer group: {e}"))
}

/// The commands of `outbox-relay inbox`.
#[derive(Debug, Subcommand)]
pub enum InboxCommand {
    /// Row counts of the group per source and status, its blocked keys, and the age of its
    /// oldest due row.
    Stats {
        #[command(flatten)]
        db: InboxDbArgs,
        /// The consumer group.
        #[arg(long, env = "INBOX_GROUP", value_parser = parse_group)]
        group: ConsumerGroup,
        /// Prints JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// The lease TTL the group's processors use (a lock older than this is not "held").
        #[arg(long, env = "INBOX_LEASE", default_value = "300s", value_parser = parse_dur)]
        lease: Duration,
    },
    /// Keys (source and partition key) of the group whose first row waits for a retry or is
    /// held under a live lease, oldest first; rows without a partition key are not keys here.
    BlockedKeys {
        #[command(flatten)]
        db: InboxDbArgs,
        /// The consumer group.
        #[arg(long, env = "INBOX_GROUP", value_parser = parse_group)]
        group: ConsumerGroup,
        /// Prints JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// At most this many keys.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..))]
        limit: u32,
        /// The lease TTL the group's processors use.
        #[arg(long, env = "INBOX_LEASE", default_value = "300s", value_parser = parse_dur)]
        lease: Duration,
    },
    /// Moves one failed row back to pending (attempts 0, last error cleared, due now): its key
    /// goes on with it in write order.
    RequeueFailed {
        #[command(flatten)]
        db: InboxDbArgs,
        /// The row id (the inbox row's `id`, not its message id).
        id: Uuid,
        /// When given, the row must belong to this consumer group (refused otherwise).
        #[arg(long, env = "INBOX_GROUP", value_parser = parse_group)]
        group: Option<ConsumerGroup>,
        /// Prints JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Redrives parked rows of the group (pending with every attempt spent, kept by a runner or
    /// processor with on_exhausted park): each is due now, ahead of its key's later rows. One
    /// id, every parked row of --source and --key, or of --source. Any other row is refused
    /// with its state (exit 1, nothing changed).
    #[command(group(clap::ArgGroup::new("which").required(true).multiple(true).args(["id", "source"])))]
    Redrive {
        #[command(flatten)]
        db: InboxDbArgs,
        /// The consumer group.
        #[arg(long, env = "INBOX_GROUP", value_parser = parse_group)]
        group: ConsumerGroup,
        #[command(flatten)]
        rows: InboxParkedArgs,
        /// Prints JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Discards parked rows of the group: each becomes failed with last error
    /// `discarded: <reason>; ` and its old error; its key goes on without it. Rows as `redrive`.
    #[command(group(clap::ArgGroup::new("which").required(true).multiple(true).args(["id", "source"])))]
    Discard {
        #[command(flatten)]
        db: InboxDbArgs,
        /// The consumer group.
        #[arg(long, env = "INBOX_GROUP", value_parser = parse_group)]
        group: ConsumerGroup,
        #[command(flatten)]
        rows: InboxParkedArgs,
        /// Why (1 to 255 characters after trimming).
        #[arg(long)]
        reason: String,
        /// Prints JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Releases pending rows of every group locked longer ago than --older-than (processors
    /// that died).
    ReleaseStaleLocks {
        #[command(flatten)]
        db: InboxDbArgs,
        /// Lock age, at least 1s (e.g. 10m).
        #[arg(long, value_parser = parse_dur)]
        older_than: Duration,
        /// Prints JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Deletes completed rows of every group completed longer ago than --older-than (whole
    /// days, at least 1d).
    Cleanup {
        #[command(flatten)]
        db: InboxDbArgs,
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
        db: InboxDbArgs,
        /// The row id (the inbox row's `id`, not its message id).
        id: Uuid,
        /// Why (1 to 255 characters after trimming); stored as `Force unlock: <reason>`.
        #[arg(long)]
        reason: String,
        /// When given, the row must belong to this consumer group (refused otherwise).
        #[arg(long, env = "INBOX_GROUP", value_parser = parse_group)]
        group: Option<ConsumerGroup>,
        /// Prints JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

/// The parked rows of `inbox redrive` and `inbox discard` (R192).
#[derive(Debug, Clone, Args)]
pub struct InboxParkedArgs {
    /// The row id (the inbox row's `id`, not its message id).
    #[arg(conflicts_with_all = ["source", "key"])]
    pub id: Option<Uuid>,
    /// Every parked row of the group from this source (with --key: of that key only).
    #[arg(long)]
    pub source: Option<String>,
    /// With --source: every parked row of this partition key.
    #[arg(long, requires = "source")]
    pub key: Option<String>,
}

/// Runs one inbox command.
pub async fn dispatch(cmd: InboxCommand) -> Result<()> {
    match cmd {
        InboxCommand::Stats {
            db,
            group,
            json,
            lease,
        } => stats(&db, &group, json, lease).await,
        InboxCommand::BlockedKeys {
            db,
            group,
            json,
            limit,
            lease,
        } => blocked_keys(&db, &group, json, limit as usize, lease).await,
        InboxCommand::RequeueFailed {
            db,
            id,
            group,
            json,
        } => requeue_failed(&db, id, group.as_ref(), json).await,
        InboxCommand::ReleaseStaleLocks {
            db,
            older_than,
            json,
        } => release_stale_locks(&db, older_than, json).await,
        InboxCommand::Cleanup {
            db,
            older_than,
            batch_size,
            json,
        } => cleanup(&db, older_than, batch_size, json).await,
        InboxCommand::Redrive {
            db,
            group,
            rows,
            json,
        } => parked(&db, &group, rows, None, json).await,
        InboxCommand::Discard {
            db,
            group,
            rows,
            reason,
            json,
        } => parked(&db, &group, rows, Some(&reason), json).await,
        InboxCommand::ForceUnlock {
            db,
            id,
            reason,
            group,
            json,
        } => force_unlock(&db, id, &reason, group.as_ref(), json).await,
    }
}

async fn open(db: &InboxDbArgs) -> Result<InboxStore> {
    store::open_inbox(&db.conn, &db.table, 4).await
}

/// The repository error of this inbox table, with the inbox's advice.
fn repo_err(t: &str) -> impl Fn(txoutbox_core::RepositoryError) -> CliError + '_ {
    move |e| CliError::repo_of(TableRole::Inbox, t, e)
}

/// With `--group`: refuses (exit 1, nothing changed) a row that does not exist or belongs to
/// another group. A row's group never changes, so the check holds for the write that follows.
async fn check_group(
    s: &InboxStore,
    t: &str,
    id: Uuid,
    group: Option<&ConsumerGroup>,
) -> Result<()> {
    let Some(group) = group else {
        return Ok(());
    };
    match s.repo.get(id).await.map_err(repo_err(t))? {
        None => Err(CliError::refused(format!(
            "no {} {id} in {t}; nothing changed",
            TableRole::Inbox.row()
        ))),
        Some(row) if row.consumer_group != group.as_str() => Err(CliError::refused(format!(
            "{} {id} belongs to consumer group {:?}, not {:?}; nothing changed",
            TableRole::Inbox.row(),
            row.consumer_group,
            group.as_str()
        ))),
        Some(_) => Ok(()),
    }
}

#[derive(serde::Serialize)]
struct StatsOut {
    table: String,
    consumer_group: String,
    counts: Vec<txoutbox_core::inbox::repository::InboxStatusCount>,
    #[serde(flatten)]
    totals: Totals,
    blocked_keys: usize,
    oldest_due_age_seconds: Option<f64>,
}

async fn stats(db: &InboxDbArgs, group: &ConsumerGroup, json: bool, lease: Duration) -> Result<()> {
    let s = open(db).await?;
    let t = s.table.to_string();
    let e = repo_err(&t);
    let counts = s.repo.counts(group).await.map_err(&e)?;
    let blocked = s
        .repo
        .blocked_keys(group, lease, 10_000)
        .await
        .map_err(&e)?;
    let oldest = s.repo.oldest_due_age(group).await.map_err(&e)?;
    let out = StatsOut {
        table: t.clone(),
        consumer_group: group.as_str().to_owned(),
        totals: Totals::sum(counts.iter().map(|c| (c.status, c.count))),
        blocked_keys: blocked.len(),
        oldest_due_age_seconds: oldest.map(|d| d.as_secs_f64()),
        counts,
    };
    report(json, &out, || {
        ops::stats_text(
            &format!("table {}  consumer group {}", out.table, out.consumer_group),
            "SOURCE",
            out.counts
                .iter()
                .map(|c| (c.source.as_str(), c.status, c.count)),
            out.totals,
            out.blocked_keys,
            oldest,
        )
    });
    Ok(())
}

async fn blocked_keys(
    db: &InboxDbArgs,
    group: &ConsumerGroup,
    json: bool,
    limit: usize,
    lease: Duration,
) -> Result<()> {
    let s = open(db).await?;
    let t = s.table.to_string();
    let keys = s
        .repo
        .blocked_keys(group, lease, limit)
        .await
        .map_err(repo_err(&t))?;
    report(json, &keys, || {
        let rows = keys
            .iter()
            .map(|k| BlockedRow {
                scope: &k.source,
                key: &k.partition_key,
                head: k.head_id,
                attempts_made: k.attempts_made,
                max_attempts: k.max_attempts,
                next_try: k.next_try,
                locked_by: k.locked_by.as_deref(),
                waiting: k.waiting,
                last_error: k.last_error.as_deref(),
                parked: k.parked,
            })
            .collect();
        ops::blocked_text(
            "SOURCE",
            rows,
            format!("no blocked keys of consumer group {group} in {t}"),
        )
    });
    Ok(())
}

async fn requeue_failed(
    db: &InboxDbArgs,
    id: Uuid,
    group: Option<&ConsumerGroup>,
    json: bool,
) -> Result<()> {
    let s = open(db).await?;
    let t = s.table.to_string();
    check_group(&s, &t, id, group).await?;
    if s.repo.requeue_failed(id).await.map_err(repo_err(&t))? {
        let out = RequeuedOut {
            table: t,
            requeued: vec![id],
        };
        report(json, &out, || format!("requeued {id}"));
        return Ok(());
    }
    let status = s
        .repo
        .get(id)
        .await
        .map_err(repo_err(&t))?
        .map(|r| r.status);
    Err(ops::not_requeued(TableRole::Inbox, &t, id, status))
}

/// `inbox redrive` (no reason) and `inbox discard` (R192).
async fn parked(
    db: &InboxDbArgs,
    group: &ConsumerGroup,
    rows: InboxParkedArgs,
    reason: Option<&str>,
    json: bool,
) -> Result<()> {
    let (target, what) = ops::parked_target(rows.id, rows.source, rows.key)?;
    let what = what.replacen("topic", "source", 1);
    if let Some(r) = reason {
        ops::check_discard(r)?;
    }
    let s = open(db).await?;
    let t = s.table.to_string();
    let ids = match reason {
        None => s.repo.redrive(group, &target).await,
        Some(r) => s.repo.discard(group, &target, r).await,
    }
    .map_err(repo_err(&t))?;
    let op = if reason.is_some() {
        "discard"
    } else {
        "redrive"
    };
    if ids.is_empty() {
        return Err(ops::nothing_parked(
            op,
            &format!("{what} of consumer group {group}"),
            &t,
        ));
    }
    let n = ids.len();
    match reason {
        None => report(
            json,
            &ops::RedrivenOut {
                table: t,
                redriven: ids,
            },
            || {
                format!(
                    "redrove {n} parked rows of {what} (consumer group {group}); each is due now, ahead of its key's later rows"
                )
            },
        ),
        Some(r) => report(
            json,
            &ops::DiscardedOut {
                table: t,
                discarded: ids,
                reason: r.trim().to_owned(),
            },
            || {
                format!(
                    "discarded {n} parked rows of {what} (consumer group {group}; now failed); their keys go on without them"
                )
            },
        ),
    }
    Ok(())
}

async fn release_stale_locks(db: &InboxDbArgs, older_than: Duration, json: bool) -> Result<()> {
    ops::check_stale_age(older_than)?;
    let s = open(db).await?;
    let t = s.table.to_string();
    let n = s
        .repo
        .release_stale_locks(older_than)
        .await
        .map_err(repo_err(&t))?;
    let out = ReleasedOut {
        table: t,
        released: n,
    };
    report(json, &out, || {
        format!("released {n} stale locks (every consumer group)")
    });
    Ok(())
}

async fn cleanup(
    db: &InboxDbArgs,
    older_than: Duration,
    batch_size: usize,
    json: bool,
) -> Result<()> {
    let days = ops::retention_days(older_than, batch_size)?;
    let s = open(db).await?;
    let t = s.table.to_string();
    let n = s
        .repo
        .cleanup_old_events(days, batch_size, DEFAULT_CLEANUP_MAX_ITERATIONS)
        .await
        .map_err(repo_err(&t))?;
    let out = DeletedOut {
        table: t,
        deleted: n,
        older_than_days: days,
    };
    report(json, &out, || {
        format!("deleted {n} completed rows older than {days} days (every consumer group)")
    });
    Ok(())
}

async fn force_unlock(
    db: &InboxDbArgs,
    id: Uuid,
    reason: &str,
    group: Option<&ConsumerGroup>,
    json: bool,
) -> Result<()> {
    ops::check_reason(reason)?;
    let s = open(db).await?;
    let t = s.table.to_string();
    check_group(&s, &t, id, group).await?;
    s.repo
        .force_unlock(id, reason)
        .await
        .map_err(repo_err(&t))?;
    let out = UnlockedOut {
        table: t,
        force_unlocked: id,
    };
    report(json, &out, || format!("force-unlocked {id}"));
    Ok(())
}
