//! The end-to-end fault trial (issue "Real subscriptions and the whole path under faults"): every
//! event a service commits has its effect in the consuming service exactly once, in write order
//! per key, whatever crashes in between.
//!
//! The path, all real processes: `orders` writes each order's row and its event in one
//! transaction (one customer's orders in sequence, `seq` in the payload); two `outbox-relay`
//! processes (one in lease delivery, one in transaction delivery) publish them to the broker;
//! two `billing` processes of one group consume them into their inbox, and the handler writes a
//! ledger row (message id, customer, seq) in the inbox transaction, failing at random 5 % of the
//! time (a recorded, counted failure that the embedded processor retries with backoff). The
//! relays and the runners reach the broker through a fault-injecting proxy.
//!
//! During the run: `kill -9` of a relay or a runner every few seconds (each restarted at once),
//! a 10 s broker outage (5 s refused, then 5 s black-holed), a PostgreSQL restart, and 1 % of
//! the events published again by hand with the same event id (on NATS after the stream's 1 s
//! duplicate window, so JetStream delivers the copy; Kafka and RabbitMQ deliver every copy).
//! Afterwards it checks from the database alone: every committed event has exactly one ledger
//! row; per customer the ledger follows the write order (asserted where the contract promises
//! it, [`order_promised`], else reported); no inbox row is left pending or held. It prints the
//! figures: kills, outage, restarts, copies injected, injected handler failures, the rate and
//! the p50/p99 latency from the order's commit to its ledger row's commit.
//!
//! The brokers: NATS JetStream (a memory stream per trial), Redis Streams (a key prefix per
//! trial), Kafka (a private Tansu per trial, `TANSU_BIN` or what `scripts/tansu path` prints,
//! advertising the proxy's address so that every client connection goes through it; a topic of
//! 4 partitions) and RabbitMQ (`AMQP_URL`, a quorum queue per trial on the default exchange).
//! RabbitMQ is also restarted for real, late in the run (`rabbitmqctl stop_app`, 3 s,
//! `start_app`), when `OUTBOX_E2E_BROKER_RESTART=real` or CI=true, on the node
//! `OUTBOX_E2E_RABBITMQ_NODE` (default: rabbitmqctl's); otherwise only the proxy outage, since
//! other tests on the machine use the same RabbitMQ. Tansu is never restarted: it keeps what
//! it stores in memory only.
//!
//! Size: `OUTBOX_E2E_CUSTOMERS` (default 20) × `OUTBOX_E2E_ORDERS` (default 40) orders over
//! `OUTBOX_E2E_SECONDS` (default 30) of writing. The PostgreSQL restart is real
//! (`pg_ctlcluster … restart`) when `OUTBOX_E2E_PG_RESTART=real` or CI=true, else every
//! connection through a proxy is cut and refused for 2 s (what a restart looks like to a client,
//! without restarting the server under other people's tests). Full size, as documented in
//! examples/README.md:
//!
//! ```sh
//! OUTBOX_E2E_CUSTOMERS=200 OUTBOX_E2E_ORDERS=100 OUTBOX_E2E_SECONDS=120 \
//!   cargo test --release -p txoutbox-examples --all-features --test e2e_faults -- --nocapture
//! ```

mod common;

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{database_url, nats_url, suffix};
use rand::RngExt;
use tokio::process::{Child, Command};
use txoutbox_conformance::broker::LoopbackProxy;
use txoutbox_core::{Broker, Message, OutboxRepository};
use txoutbox_postgres::sqlx::{self, PgPool};
use txoutbox_postgres::{PgConfig, PgOutboxRepository};

const ORDERS: &str = env!("CARGO_BIN_EXE_orders");
const RELAY: &str = env!("CARGO_BIN_EXE_outbox-relay");
const BILLING: &str = env!("CARGO_BIN_EXE_billing");

fn env_u32(name: &str, default: u32) -> u32 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn redis_url() -> String {
    std::env::var("OUTBOX_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

fn host_port(url: &str) -> SocketAddr {
    let rest = url.split("://").nth(1).unwrap_or(url);
    let rest = rest.rsplit('@').next().unwrap_or(rest);
    let hp = rest.split(['/', '?']).next().unwrap_or(rest);
    let hp = hp.replace("localhost", "127.0.0.1");
    hp.parse()
        .unwrap_or_else(|e| panic!("{hp}: not host:port ({e})"))
}

fn with_addr(url: &str, addr: SocketAddr) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let (auth, rest) = match rest.rsplit_once('@') {
        Some((a, r)) => (format!("{a}@"), r),
        None => (String::new(), rest),
    };
    let tail = rest.find(['/', '?']).map(|i| &rest[i..]).unwrap_or("");
    format!("{scheme}://{auth}{addr}{tail}")
}

fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Nats,
    Redis,
    Kafka,
    Rabbitmq,
}

/// One child process, restarted with the same arguments after a kill.
struct Proc {
    name: String,
    bin: &'static str,
    args: Vec<String>,
    logs: PathBuf,
    child: Option<Child>,
    generation: u32,
}

impl Proc {
    fn new(name: &str, bin: &'static str, args: Vec<String>, logs: &std::path::Path) -> Self {
        Self {
            name: name.to_owned(),
            bin,
            args,
            logs: logs.to_owned(),
            child: None,
            generation: 0,
        }
    }

    fn start(&mut self) {
        self.generation += 1;
        let log = self
            .logs
            .join(format!("{}-{}.log", self.name, self.generation));
        let out = std::fs::File::create(&log).expect("log file");
        let err = out.try_clone().expect("log file");
        let args: Vec<String> = self
            .args
            .iter()
            .map(|a| a.replace("{gen}", &self.generation.to_string()))
            .collect();
        let child = Command::new(self.bin)
            .args(&args)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", self.name));
        self.child = Some(child);
    }

    /// `kill -9`, then at once a new process with the same arguments.
    async fn kill9_and_restart(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.start_kill();
            let _ = c.wait().await;
        }
        self.start();
    }

    /// Whether the process exited on its own (a failure unless it is `orders`).
    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    async fn terminate(&mut self) {
        if let Some(mut c) = self.child.take() {
            if let Some(pid) = c.id() {
                let _ = std::process::Command::new("kill")
                    .args(["-TERM", &pid.to_string()])
                    .status();
            }
            if tokio::time::timeout(Duration::from_secs(10), c.wait())
                .await
                .is_err()
            {
                let _ = c.start_kill();
                let _ = c.wait().await;
            }
        }
    }

    fn log_lines(&self, needle: &str) -> usize {
        (1..=self.generation)
            .map(|g| {
                std::fs::read_to_string(self.logs.join(format!("{}-{g}.log", self.name)))
                    .unwrap_or_default()
                    .lines()
                    .filter(|l| l.contains(needle))
                    .count()
            })
            .sum()
    }
}

/// The PostgreSQL restart: real, or every connection through a proxy cut and refused.
enum PgFault {
    Real,
    Proxy(LoopbackProxy),
}

impl PgFault {
    async fn restart(&self) {
        match self {
            PgFault::Real => {
                // OUTBOX_E2E_PG_CLUSTER=<version>/<name> (a cluster of its own, so that the
                // restart disturbs no other test); default: the first version's `main`.
                let (version, name) = match std::env::var("OUTBOX_E2E_PG_CLUSTER") {
                    Ok(v) => {
                        let (a, b) = v
                            .split_once('/')
                            .expect("OUTBOX_E2E_PG_CLUSTER is <version>/<name>, e.g. 15/e2e");
                        (a.to_owned(), b.to_owned())
                    }
                    Err(_) => (
                        std::fs::read_dir("/etc/postgresql")
                            .expect("/etc/postgresql: the cluster to restart")
                            .filter_map(|e| e.ok())
                            .map(|e| e.file_name().to_string_lossy().into_owned())
                            .next()
                            .expect("a PostgreSQL cluster version under /etc/postgresql"),
                        "main".to_owned(),
                    ),
                };
                let st = std::process::Command::new("pg_ctlcluster")
                    .args([
                        "--skip-systemctl-redirect",
                        &version,
                        &name,
                        "restart",
                        "-m",
                        "fast",
                    ])
                    .status()
                    .expect("pg_ctlcluster");
                assert!(st.success(), "pg_ctlcluster restart failed: {st}");
            }
            PgFault::Proxy(p) => {
                p.close().await;
                tokio::time::sleep(Duration::from_secs(2)).await;
                p.reopen().await;
            }
        }
    }
}

struct Figures {
    relay_kills: u32,
    runner_kills: u32,
    copies: usize,
    pg_restarts: u32,
    broker_restarts: u32,
}

/// One trial at a time: each restarts PostgreSQL and loads the machine.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Two runners of one group, or one (always the same consumer, killed and restarted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Runners {
    /// Two runners of one group: every effect once; order is reported, not promised (a
    /// delivery a killed runner left unended comes back after later ones, R146 (b), (c)).
    TwoOfOneGroup,
    /// One runner whose restarts keep its consumer name: on Redis it reads its own pending
    /// entries first (R135), so per-key order holds through every fault, and is asserted.
    OneStable,
}

/// Whether the contract promises per-key order for this configuration, so that the trial
/// asserts it (else it reports it).
fn order_promised(kind: Kind, runners: Runners) -> bool {
    match (kind, runners) {
        // Kafka: a partition has one reader in the group at a time, whoever is killed; after a
        // crash every record past the committed offset comes back in partition order, and a
        // rewound record (a PostgreSQL error) holds every later record of its partition (R146
        // (e), R176). Two runners of one group keep each key's order.
        (Kind::Kafka, _) => true,
        // Redis: R135, above.
        (Kind::Redis, Runners::OneStable) => true,
        // RabbitMQ hands a queue's messages to its consumers in turn (R146 (b), R177), and
        // even one reader (a single-active-consumer queue) does not keep order through the
        // PostgreSQL restart: a delivery rewound after the persistence error is held and
        // requeued while later messages of its key, already prefetched, land before it (R146
        // (f), which holds on RabbitMQ as on NATS). Of two trials of that kind, one gave 5 of
        // 20 keys out of order, each around the restart.
        _ => false,
    }
}

async fn trial(kind: Kind, runners_kind: Runners) {
    let _one_at_a_time = SERIAL.lock().await;
    let customers = env_u32("OUTBOX_E2E_CUSTOMERS", 20);
    let orders = env_u32("OUTBOX_E2E_ORDERS", 40);
    let seconds = env_u32("OUTBOX_E2E_SECONDS", 30).max(20);
    let real_pg = std::env::var("OUTBOX_E2E_PG_RESTART")
        .map(|v| v == "real")
        .unwrap_or(false)
        || std::env::var("CI").is_ok_and(|v| v == "true");
    let total = (customers * orders) as i64;
    let s = suffix();
    let orders_schema = format!("e2e_{s}_orders");
    let billing_schema = format!("e2e_{s}_billing");
    let logs = std::env::temp_dir().join(format!("outbox-e2e-{s}"));
    std::fs::create_dir_all(&logs).expect("log folder");
    println!(
        "e2e {kind:?}: {customers} customers x {orders} orders over {seconds} s; logs in {}",
        logs.display()
    );

    let bed = broker_bed(kind, &s, &logs).await;
    let proxy = &bed.proxy;

    // PostgreSQL, restarted for real or through a proxy.
    let pg_fault = if real_pg {
        PgFault::Real
    } else {
        PgFault::Proxy(LoopbackProxy::start(host_port(&database_url())).await)
    };
    let service_db = match &pg_fault {
        PgFault::Real => database_url(),
        PgFault::Proxy(p) => with_addr(&database_url(), p.addr()),
    };
    let pool = PgPool::connect(&database_url()).await.expect("PostgreSQL");

    let mut orders_proc = Proc::new(
        "orders",
        ORDERS,
        vec![
            "--database-url".into(),
            service_db.clone(),
            "--schema".into(),
            orders_schema.clone(),
            "--relay".into(),
            "none".into(),
            "--customers".into(),
            customers.to_string(),
            "--orders".into(),
            orders.to_string(),
            "--interval".into(),
            format!("{}ms", u64::from(seconds) * 1000 / u64::from(orders)),
        ],
        &logs,
    );
    let relay = |name: &str, delivery: &str| {
        let mut args = vec![
            "run".into(),
            "--database-url".into(),
            service_db.clone(),
            "--table".into(),
            format!("{orders_schema}.outbox_events"),
            "--worker-id".into(),
            format!("{name}-{{gen}}"),
            "--delivery".into(),
            delivery.into(),
            "--lease".into(),
            "5s".into(),
            "--publish-timeout".into(),
            "2s".into(),
            "--poll-interval".into(),
            "500ms".into(),
            "--retry-backoff-base".into(),
            "1s".into(),
            "--retry-backoff-cap".into(),
            "5s".into(),
            "--outage-backoff-cap".into(),
            "2s".into(),
        ];
        args.extend(bed.relay_args.iter().cloned());
        Proc::new(name, RELAY, args, &logs)
    };
    let billing = |name: &str| {
        let worker = match runners_kind {
            Runners::TwoOfOneGroup => format!("{name}-{{gen}}"),
            Runners::OneStable => name.to_owned(),
        };
        let mut args = vec![
            "--database-url".into(),
            service_db.clone(),
            "--schema".into(),
            billing_schema.clone(),
            "--worker-id".into(),
            worker,
            "--group".into(),
            "billing".into(),
            "--max-attempts".into(),
            "10".into(),
            "--retry-base".into(),
            "500ms".into(),
            "--retry-cap".into(),
            "3s".into(),
            "--lease".into(),
            "8s".into(),
            "--handler-timeout".into(),
            "3s".into(),
            "--fail-rate".into(),
            "0.05".into(),
        ];
        args.extend(bed.billing_args.iter().cloned());
        Proc::new(name, BILLING, args, &logs)
    };
    // The table and the inbox first (migrations of both services), then the rest.
    let mut relays = [relay("relay-a", "lease"), relay("relay-b", "transaction")];
    let mut runners = match runners_kind {
        Runners::TwoOfOneGroup => vec![billing("billing-a"), billing("billing-b")],
        Runners::OneStable => vec![billing("billing-a")],
    };
    runners[0].start();
    wait_for_table(&pool, &format!("{billing_schema}.billing_ledger")).await;
    for r in runners.iter_mut().skip(1) {
        r.start();
    }
    orders_proc.start();
    wait_for_table(&pool, &format!("{orders_schema}.outbox_events")).await;
    for r in &mut relays {
        r.start();
    }

    // The faults, on a schedule from the writers' start.
    let started = Instant::now();
    let at = |s: f64| started + Duration::from_secs_f64(s);
    let mut figures = Figures {
        relay_kills: 0,
        runner_kills: 0,
        copies: 0,
        pg_restarts: 0,
        broker_restarts: 0,
    };
    let mut copied: HashSet<String> = HashSet::new();
    let copies_wanted = (total as usize).div_ceil(100);
    let mut next_kill = at(2.0);
    let mut kill_turn = 0usize;
    let (mut refused, mut holed, mut restarted) = (false, false, false);
    let mut restart_at: Option<chrono::DateTime<chrono::Utc>> = None;
    let outage_at = f64::from(seconds) * 0.2;
    let pg_at = f64::from(seconds) * 0.7;
    let broker_restart_at = f64::from(seconds) * 0.85;
    let mut broker_restart: Option<tokio::task::JoinHandle<()>> = None;
    let repo = PgOutboxRepository::new(
        pool.clone(),
        PgConfig::default()
            .table_name(&format!("{orders_schema}.outbox_events"))
            .expect("table"),
    );
    let writing_ends = at(f64::from(seconds) + 5.0);
    while Instant::now() < writing_ends || orders_proc.exited().is_none() {
        let now = Instant::now();
        if now >= next_kill && now < at(f64::from(seconds)) {
            // In turn: relay a, a runner, relay b, a runner.
            let victim = kill_turn % 4;
            kill_turn += 1;
            if victim.is_multiple_of(2) {
                relays[victim / 2].kill9_and_restart().await;
                figures.relay_kills += 1;
            } else {
                let n = runners.len();
                runners[(victim / 2) % n].kill9_and_restart().await;
                figures.runner_kills += 1;
            }
            next_kill = now + Duration::from_secs(3);
        }
        if !refused && now >= at(outage_at) {
            println!("e2e: broker refused for 5 s");
            proxy.close().await;
            refused = true;
        }
        if refused && !holed && now >= at(outage_at + 5.0) {
            println!("e2e: broker black-holed for 5 s");
            proxy.reopen().await;
            proxy.stall();
            holed = true;
        }
        if holed && now >= at(outage_at + 10.0) && now < at(outage_at + 10.5) {
            println!("e2e: broker back");
            proxy.resume();
        }
        if !restarted && now >= at(pg_at) {
            println!(
                "e2e: PostgreSQL restart ({})",
                if real_pg { "real" } else { "proxy" }
            );
            restart_at = sqlx::query_scalar::<_, chrono::DateTime<chrono::Utc>>("SELECT now()")
                .fetch_one(&pool)
                .await
                .ok();
            pg_fault.restart().await;
            restarted = true;
            figures.pg_restarts += 1;
        }
        if let Some(r) = &bed.real_restart
            && broker_restart.is_none()
            && now >= at(broker_restart_at)
        {
            println!("e2e: broker restart (real: {r:?})");
            broker_restart = Some(r.start());
            figures.broker_restarts += 1;
        }
        let broker_restarting = broker_restart.as_ref().is_some_and(|h| !h.is_finished());
        // 1 % of the events published again with the same id, well after their first publish.
        // (not while the broker refuses: the copy would only fail; nor, when the republisher's
        // connections go through the proxy too, while it is black-holed or restarting)
        let outage = refused && now < at(outage_at + 10.5);
        if figures.copies < copies_wanted
            && now >= at(4.0)
            && (!refused || holed)
            && !(bed.republish_through_proxy && outage)
            && !broker_restarting
        {
            figures.copies +=
                republish(&pool, &orders_schema, &repo, &*bed.republisher, &mut copied).await;
        }
        if let Some(st) = orders_proc.exited()
            && !st.success()
        {
            panic!("orders exited with {st}; logs in {}", logs.display());
        }
        for p in relays.iter_mut().chain(runners.iter_mut()) {
            if let Some(st) = p.exited() {
                panic!(
                    "{} exited by itself with {st}; logs in {}",
                    p.name,
                    logs.display()
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    proxy.resume();
    if let Some(h) = broker_restart.take() {
        h.await.expect("the broker restart");
    }
    // The last copies, if the writes were too few or too fast for them.
    while figures.copies < copies_wanted {
        let n = republish(&pool, &orders_schema, &repo, &*bed.republisher, &mut copied).await;
        figures.copies += n;
        if n == 0 {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    // Drain: every event billed once, no inbox row pending or held.
    let deadline = Instant::now() + Duration::from_secs(180);
    let q = |sql: String| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql))
                .fetch_one(&pool)
                .await
                .unwrap_or(-1)
        }
    };
    loop {
        let published = q(format!(
            "SELECT count(*) FROM {orders_schema}.outbox_events WHERE status = 'completed'"
        ))
        .await;
        let billed = q(format!(
            "SELECT count(DISTINCT message_id) FROM {billing_schema}.billing_ledger"
        ))
        .await;
        let open = q(format!(
            "SELECT count(*) FROM {billing_schema}.inbox_events
              WHERE status <> 'completed' OR locked_at IS NOT NULL"
        ))
        .await;
        if published == total && billed == total && open == 0 {
            break;
        }
        if Instant::now() >= deadline {
            let why =
                explain_missing(&pool, &orders_schema, &billing_schema, &logs, &bed.diagnose).await;
            panic!(
                "not drained after 180 s: {published}/{total} published, {billed} billed, {open} inbox rows open; logs in {}\n{why}",
                logs.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    for p in relays.iter_mut().chain(runners.iter_mut()) {
        p.terminate().await;
    }

    // The checks, from the database alone.
    let rows: Vec<(String, i64, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT o.id::text, count(l.id), min(l.id)
           FROM {orders_schema}.outbox_events o
           LEFT JOIN {billing_schema}.billing_ledger l ON l.message_id = o.id::text
          GROUP BY o.id"
    )))
    .fetch_all(&pool)
    .await
    .expect("effects per event");
    let missing = rows.iter().filter(|r| r.1 == 0).count();
    let doubled = rows.iter().filter(|r| r.1 > 1).count();
    let stray: i64 = q(format!(
        "SELECT count(*) FROM {billing_schema}.billing_ledger l
          WHERE NOT EXISTS (SELECT 1 FROM {orders_schema}.outbox_events o
                             WHERE o.id::text = l.message_id)"
    ))
    .await;
    let per_key: Vec<(String, Vec<i32>)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT customer, array_agg(seq ORDER BY id) FROM {billing_schema}.billing_ledger
          GROUP BY customer"
    )))
    .fetch_all(&pool)
    .await
    .expect("ledger per customer");
    let out_of_order: BTreeMap<String, Vec<i32>> = per_key
        .into_iter()
        .filter(|(_, seqs)| seqs.windows(2).any(|w| w[1] != w[0] + 1) || seqs.first() != Some(&1))
        .collect();
    // R146 (f): after a persistence error (the PostgreSQL restart) a delivery goes back to the
    // broker, and a later message of its key handed out before it returns lands first. Such
    // inversions, all billed within 30 s of the restart, are reported, not failed.
    let near_restart: HashSet<String> = match restart_at {
        Some(t) => sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT customer FROM (
                 SELECT customer, seq, billed_at,
                        row_number() OVER (PARTITION BY customer ORDER BY id) AS pos
                   FROM {billing_schema}.billing_ledger) x
              WHERE seq <> pos
              GROUP BY customer
             HAVING bool_and(billed_at BETWEEN $1 AND $1 + interval '30 seconds')"
        )))
        .bind(t)
        .fetch_all(&pool)
        .await
        .expect("inversions near the restart")
        .into_iter()
        .collect::<HashSet<String>>(),
        None => HashSet::new(),
    };
    let (after_restart, out_of_order): (BTreeMap<String, Vec<i32>>, BTreeMap<String, Vec<i32>>) =
        out_of_order
            .into_iter()
            .partition(|(c, _)| near_restart.contains(c));
    if !after_restart.is_empty() {
        println!(
            "e2e {kind:?}: {} customers billed out of write order right after the PostgreSQL restart (R146 (f): not promised across a persistence error): {after_restart:?}",
            after_restart.len()
        );
    }
    let failures_recorded = q(format!(
        "SELECT coalesce(sum(attempts_made), 0)::int8 FROM {billing_schema}.inbox_events"
    ))
    .await;
    let injected: usize = runners
        .iter()
        .map(|r| r.log_lines("injected failure"))
        .sum();
    let lat: Vec<f64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT extract(epoch FROM l.billed_at - o.created_at)::float8
           FROM {billing_schema}.billing_ledger l
           JOIN {orders_schema}.outbox_events o ON o.id::text = l.message_id
          ORDER BY 1"
    )))
    .fetch_all(&pool)
    .await
    .expect("latencies");
    let span: f64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT extract(epoch FROM (SELECT max(billed_at) FROM {billing_schema}.billing_ledger)
                                 - (SELECT min(created_at) FROM {orders_schema}.outbox_events))::float8"
    )))
    .fetch_one(&pool)
    .await
    .expect("span");
    let pct = |p: f64| lat[((lat.len() as f64 - 1.0) * p).round() as usize];
    println!(
        "e2e {kind:?} {runners_kind:?} figures: {total} events; kills: {} relay, {} runner; broker outage 5 s refused + 5 s black-holed; broker restarts {} (real); PostgreSQL restarts {} ({}); copies published again {}; injected handler failures {injected} (attempts recorded in the inbox {failures_recorded}); effects: {} rows, missing {missing}, doubled {doubled}, stray {stray}, keys out of order {}; rate {:.1} events/s over {span:.1} s; commit-to-effect p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms",
        figures.relay_kills,
        figures.runner_kills,
        figures.broker_restarts,
        figures.pg_restarts,
        if real_pg { "real" } else { "proxy" },
        figures.copies,
        lat.len(),
        out_of_order.len(),
        total as f64 / span,
        pct(0.5) * 1000.0,
        pct(0.99) * 1000.0,
        lat.last().copied().unwrap_or(0.0) * 1000.0,
    );
    assert_eq!(
        missing,
        0,
        "events without an effect; logs in {}",
        logs.display()
    );
    assert_eq!(
        doubled,
        0,
        "events with more than one effect; logs in {}",
        logs.display()
    );
    assert_eq!(stray, 0, "effects of no committed event");
    if order_promised(kind, runners_kind) {
        assert!(
            out_of_order.is_empty(),
            "customers billed out of write order ({kind:?}, {runners_kind:?}, where order is promised): {out_of_order:?}; logs in {}",
            logs.display()
        );
    } else if !out_of_order.is_empty() {
        println!(
            "e2e {kind:?}: {} customers billed out of write order by two runners of one group under kills (R146 (b), (c), (f): not promised); first: {:?}",
            out_of_order.len(),
            out_of_order.iter().next()
        );
    }
    assert!(figures.copies >= copies_wanted, "copies injected");
    assert!(
        figures.relay_kills >= 2 && figures.runner_kills >= 2,
        "kills happened"
    );
    assert!(
        failures_recorded > 0 && injected > 0,
        "the handler's injected failures were recorded ({injected} injected, {failures_recorded} recorded)"
    );

    for schema in [&orders_schema, &billing_schema] {
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
            .execute(&pool)
            .await;
    }
    let _ = std::fs::remove_dir_all(&logs);
    bed.cleanup().await;
}

/// The broker of a trial: the proxy the relays and the runners reach it through, their flags,
/// the republisher of the copies, and what the trial started or declared for it.
struct BrokerBed {
    proxy: LoopbackProxy,
    relay_args: Vec<String>,
    billing_args: Vec<String>,
    republisher: Box<dyn Broker>,
    /// The republisher reaches the broker through the proxy too (Kafka: the private broker
    /// advertises the proxy's address to every client), so no copy is tried during the outage.
    republish_through_proxy: bool,
    /// A real restart of the broker, besides the proxy outage.
    real_restart: Option<RealRestart>,
    /// The private Tansu of the Kafka trial (killed on drop).
    tansu: Option<Child>,
    /// The RabbitMQ queue declared for the trial (deleted at the end).
    queue: Option<String>,
    /// What to ask the broker about an event that has no effect (a failed drain's report).
    diagnose: Diagnose,
}

impl BrokerBed {
    async fn cleanup(mut self) {
        if let Some(q) = self.queue.take() {
            use txoutbox_rabbitmq_broker::lapin::options::QueueDeleteOptions;
            if let Ok(ch) = amqp_channel(&amqp_url()).await {
                let _ = ch
                    .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                    .await;
            }
        }
        if let Some(mut t) = self.tansu.take() {
            let _ = t.start_kill();
            let _ = t.wait().await;
        }
        self.proxy.shutdown().await;
    }
}

/// A real broker restart: RabbitMQ's application stopped and started again on its node
/// (`rabbitmqctl stop_app`, 3 s, `start_app`; the Erlang node stays up). Only when
/// `OUTBOX_E2E_BROKER_RESTART=real` or CI=true, since other tests on the machine use the same
/// RabbitMQ; `OUTBOX_E2E_RABBITMQ_NODE` names the node (default: rabbitmqctl's).
#[derive(Debug, Clone)]
struct RealRestart {
    node: Option<String>,
}

impl RealRestart {
    fn from_env() -> Option<Self> {
        let real = std::env::var("OUTBOX_E2E_BROKER_RESTART").is_ok_and(|v| v == "real")
            || std::env::var("CI").is_ok_and(|v| v == "true");
        real.then(|| Self {
            node: std::env::var("OUTBOX_E2E_RABBITMQ_NODE").ok(),
        })
    }

    /// Runs the restart on a blocking thread; the faults' schedule goes on meanwhile.
    fn start(&self) -> tokio::task::JoinHandle<()> {
        let node = self.node.clone();
        tokio::task::spawn_blocking(move || {
            let ctl = |what: &str| {
                let mut c = std::process::Command::new("rabbitmqctl");
                if let Some(n) = &node {
                    c.args(["-n", n]);
                }
                let st = c
                    .arg(what)
                    .stdout(Stdio::null())
                    .status()
                    .unwrap_or_else(|e| panic!("rabbitmqctl {what}: {e}"));
                assert!(st.success(), "rabbitmqctl {what} failed: {st}");
            };
            ctl("stop_app");
            std::thread::sleep(Duration::from_secs(3));
            ctl("start_app");
            ctl("await_startup");
        })
    }
}

async fn amqp_channel(
    url: &str,
) -> Result<txoutbox_rabbitmq_broker::lapin::Channel, txoutbox_rabbitmq_broker::lapin::Error> {
    use txoutbox_rabbitmq_broker::lapin::{Connection, ConnectionProperties};
    Connection::connect(url, ConnectionProperties::default())
        .await?
        .create_channel()
        .await
}

/// Sets up the trial's broker: a fresh stream, key prefix, topic or queue, and a proxy in front
/// of it for the relays and the runners.
async fn broker_bed(kind: Kind, s: &str, logs: &std::path::Path) -> BrokerBed {
    let strings = |v: &[&str]| v.iter().map(|a| (*a).to_owned()).collect::<Vec<String>>();
    match kind {
        Kind::Nats => {
            let stream = format!("E2E_{}", s.to_uppercase());
            let prefix = format!("e2e{s}.");
            let client = txoutbox_nats_broker::async_nats::connect(nats_url())
                .await
                .expect("NATS with JetStream at OUTBOX_TEST_NATS_URL");
            let js = txoutbox_nats_broker::async_nats::jetstream::new(client);
            js.create_stream(
                txoutbox_nats_broker::async_nats::jetstream::stream::Config {
                    name: stream.clone(),
                    subjects: vec![format!("{prefix}>")],
                    // Short, so a copy published 1.5 s later is delivered again (a relay that
                    // published twice, far apart).
                    duplicate_window: Duration::from_secs(1),
                    storage:
                        txoutbox_nats_broker::async_nats::jetstream::stream::StorageType::Memory,
                    ..Default::default()
                },
            )
            .await
            .expect("create the stream");
            let proxy = LoopbackProxy::start(host_port(&nats_url())).await;
            let url = with_addr(&nats_url(), proxy.addr());
            BrokerBed {
                diagnose: Diagnose::Nothing,
                relay_args: strings(&[
                    "--broker",
                    "nats",
                    "--nats-url",
                    &url,
                    "--nats-stream",
                    &stream,
                    "--nats-subject-prefix",
                    &prefix,
                    "--broker-timeout",
                    "2s",
                ]),
                billing_args: strings(&[
                    "--broker",
                    "nats",
                    "--nats-url",
                    &url,
                    "--nats-stream",
                    &stream,
                    "--subject-prefix",
                    &prefix,
                    "--ack-wait",
                    "4s",
                ]),
                republisher: Box::new(
                    txoutbox_nats_broker::NatsBroker::connect(
                        txoutbox_nats_broker::NatsBrokerConfig::new(nats_url())
                            .subject_prefix(prefix),
                    )
                    .await
                    .expect("the republisher's NATS connection"),
                ),
                proxy,
                republish_through_proxy: false,
                real_restart: None,
                tansu: None,
                queue: None,
            }
        }
        Kind::Redis => {
            let prefix = format!("e2e{s}:");
            let proxy = LoopbackProxy::start(host_port(&redis_url())).await;
            let url = with_addr(&redis_url(), proxy.addr());
            BrokerBed {
                diagnose: Diagnose::Redis {
                    stream: format!("{prefix}orders"),
                    group: "billing".into(),
                },
                relay_args: strings(&[
                    "--broker",
                    "redis",
                    "--redis-url",
                    &url,
                    "--redis-key-pattern",
                    &format!("{prefix}{{topic}}"),
                    "--broker-timeout",
                    "2s",
                ]),
                billing_args: strings(&[
                    "--broker",
                    "redis",
                    "--redis-url",
                    &url,
                    "--redis-key-prefix",
                    &prefix,
                    "--claim-idle",
                    "4s",
                ]),
                republisher: Box::new(
                    txoutbox_redis_broker::RedisBroker::connect(
                        txoutbox_redis_broker::RedisBrokerConfig::new(redis_url())
                            .key_pattern(format!("{prefix}{{topic}}")),
                    )
                    .await
                    .expect("the republisher's Redis connection"),
                ),
                proxy,
                republish_through_proxy: false,
                real_restart: None,
                tansu: None,
                queue: None,
            }
        }
        Kind::Kafka => {
            // A private Tansu behind the proxy, never the shared one on 9092. A Kafka client
            // connects to the address the broker advertises, not the one it bootstrapped from,
            // so only a broker that advertises the proxy's address has every connection go
            // through the proxy (the shared one advertises 127.0.0.1:9092). The broker fault is
            // the proxy's outage, not a restart: Tansu keeps what it stores in memory only (the
            // binary has no durable storage engine), so a restarted Tansu has lost every record
            // and committed offset, which is a new broker rather than a restart. K-19
            // (outbox-kafka-broker/tests/restart.rs) restarts one under the relay for what that
            // can show.
            let listen = txoutbox_conformance::broker::closed_port().await;
            let proxy = LoopbackProxy::start(listen).await;
            let tansu = start_tansu(listen, proxy.addr(), logs).await;
            let prefix = format!("e2e{s}.");
            let bootstrap = proxy.addr().to_string();
            create_kafka_topic(&bootstrap, &format!("{prefix}orders"), 4).await;
            BrokerBed {
                diagnose: Diagnose::Nothing,
                relay_args: strings(&[
                    "--broker",
                    "kafka",
                    "--kafka-brokers",
                    &bootstrap,
                    "--kafka-topic-prefix",
                    &prefix,
                    // Below --publish-timeout (R88).
                    "--broker-timeout",
                    "1500ms",
                ]),
                billing_args: strings(&[
                    "--broker",
                    "kafka",
                    "--kafka-brokers",
                    &bootstrap,
                    "--kafka-topic-prefix",
                    &prefix,
                    // A killed runner's partitions go to the other one after it. Tansu takes
                    // 2 s (Apache Kafka's default lower bound is 6 s); with 6 s the kill every
                    // 6 s of a runner kept the group rebalancing most of the run.
                    "--kafka-session-timeout",
                    "2s",
                ]),
                republisher: Box::new(
                    txoutbox_kafka_broker::KafkaBroker::connect(
                        txoutbox_kafka_broker::KafkaBrokerConfig::new(bootstrap.clone())
                            .topic_prefix(prefix)
                            .delivery_timeout(Duration::from_secs(2)),
                    )
                    .await
                    .expect("the republisher's Kafka connection"),
                ),
                proxy,
                republish_through_proxy: true,
                real_restart: None,
                tansu: Some(tansu),
                queue: None,
            }
        }
        Kind::Rabbitmq => {
            use txoutbox_rabbitmq_broker::lapin::options::QueueDeclareOptions;
            use txoutbox_rabbitmq_broker::lapin::types::{AMQPValue, FieldTable};
            let prefix = format!("e2e{s}.");
            let queue = format!("{prefix}orders");
            let mut args = FieldTable::default();
            args.insert(
                "x-queue-type".into(),
                AMQPValue::LongString("quorum".into()),
            );
            amqp_channel(&amqp_url())
                .await
                .expect("RabbitMQ at AMQP_URL")
                .queue_declare(
                    queue.as_str().into(),
                    QueueDeclareOptions {
                        durable: true,
                        ..Default::default()
                    },
                    args,
                )
                .await
                .expect("declare the quorum queue");
            let proxy = LoopbackProxy::start(host_port(&amqp_url())).await;
            let url = with_addr(&amqp_url(), proxy.addr());
            BrokerBed {
                diagnose: Diagnose::Nothing,
                relay_args: strings(&[
                    "--broker",
                    "rabbitmq",
                    "--amqp-url",
                    &url,
                    "--rabbitmq-routing-key-prefix",
                    &prefix,
                    // Below --publish-timeout (R90).
                    "--broker-timeout",
                    "1500ms",
                ]),
                billing_args: strings(&[
                    "--broker",
                    "rabbitmq",
                    "--amqp-url",
                    &url,
                    "--rabbitmq-routing-key-prefix",
                    &prefix,
                    "--rabbitmq-queue",
                    &queue,
                ]),
                republisher: Box::new(
                    txoutbox_rabbitmq_broker::RabbitMqBroker::connect(
                        txoutbox_rabbitmq_broker::RabbitMqBrokerConfig::new(amqp_url())
                            .routing_key_prefix(prefix)
                            .confirm_timeout(Duration::from_secs(2)),
                    )
                    .await
                    .expect("the republisher's RabbitMQ connection"),
                ),
                proxy,
                republish_through_proxy: false,
                real_restart: RealRestart::from_env(),
                tansu: None,
                queue: Some(queue),
            }
        }
    }
}

/// Starts a private Tansu (memory storage) listening on `listen` and advertising `advertised`,
/// its output in `logs`, and waits until it accepts connections.
async fn start_tansu(listen: SocketAddr, advertised: SocketAddr, logs: &std::path::Path) -> Child {
    let bin = match std::env::var_os("TANSU_BIN") {
        Some(p) => PathBuf::from(p),
        None => {
            let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/tansu");
            let out = std::process::Command::new("bash")
                .arg(&script)
                .arg("path")
                .output()
                .unwrap_or_else(|e| panic!("run {}: {e}", script.display()));
            assert!(
                out.status.success(),
                "scripts/tansu path failed (run scripts/tansu install): {}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8(out.stdout).expect("path").trim().into()
        }
    };
    let log = std::fs::File::create(logs.join("tansu.log")).expect("log file");
    let child = Command::new(&bin)
        .args([
            "broker",
            "--listener-url",
            &format!("tcp://{listen}"),
            "--advertised-listener-url",
            &format!("tcp://{advertised}"),
            "--storage-engine",
            &format!("memory://tansu-e2e-{}/", suffix()),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::from(log.try_clone().expect("log file")))
        .stderr(Stdio::from(log))
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("start {}: {e}", bin.display()));
    for _ in 0..100 {
        if tokio::net::TcpStream::connect(listen).await.is_ok() {
            return child;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the private Tansu did not listen on {listen} within 10 s");
}

async fn create_kafka_topic(bootstrap: &str, name: &str, partitions: i32) {
    use txoutbox_kafka_broker::krafka::Kafka;
    use txoutbox_kafka_broker::krafka::admin::{CreateTopicsOptions, NewTopic};
    let admin = Kafka::builder(bootstrap.to_owned())
        .client_id("e2e-admin")
        .request_timeout(Duration::from_secs(4))
        .connect_timeout(Duration::from_secs(2))
        .connect()
        .await
        .unwrap_or_else(|e| panic!("Kafka at {bootstrap}: {e}"))
        .admin();
    let topic = NewTopic::new(name, partitions, 1).expect("topic spec");
    for (n, r) in admin
        .create_topics([topic], CreateTopicsOptions::default())
        .await
        .expect("create topics")
    {
        r.unwrap_or_else(|e| panic!("create topic {n}: {e}"));
    }
}

/// Publishes again, with the same event id, events completed at least 1.5 s ago; returns how
/// many (at most 3 a call).
async fn republish(
    pool: &PgPool,
    schema: &str,
    repo: &PgOutboxRepository,
    broker: &dyn Broker,
    done: &mut HashSet<String>,
) -> usize {
    let ids: Vec<uuid::Uuid> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT id FROM {schema}.outbox_events
          WHERE status = 'completed' AND completed_at < now() - interval '1500 milliseconds'
          ORDER BY random() LIMIT 3"
    )))
    .fetch_all(pool)
    .await
    .unwrap_or_default();
    let mut n = 0;
    for id in ids {
        if done.contains(&id.to_string()) {
            continue;
        }
        let Ok(Some(event)) = repo.get(id).await else {
            continue;
        };
        if broker.publish(&Message::from_event(&event)).await.is_ok() {
            done.insert(id.to_string());
            n += 1;
        }
        if rand::rng().random_range(0..2) == 0 {
            break;
        }
    }
    n
}

async fn wait_for_table(pool: &PgPool, table: &str) {
    for _ in 0..240 {
        let found: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
            .bind(table)
            .fetch_one(pool)
            .await
            .unwrap_or(None);
        if found.is_some() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    panic!("{table} was not created within 60 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_faults_nats_two_runners() {
    trial(Kind::Nats, Runners::TwoOfOneGroup).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_faults_redis_two_runners() {
    trial(Kind::Redis, Runners::TwoOfOneGroup).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_faults_redis_one_runner_in_order() {
    trial(Kind::Redis, Runners::OneStable).await;
}

/// What a failed drain asks the broker about.
enum Diagnose {
    Nothing,
    Redis { stream: String, group: String },
}

/// A failed drain's report: the events without an effect, their inbox rows, the log lines that
/// name them, and (on Redis) where their stream entries are.
async fn explain_missing(
    pool: &PgPool,
    orders_schema: &str,
    billing_schema: &str,
    logs: &std::path::Path,
    diagnose: &Diagnose,
) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let ids: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT o.id::text FROM {orders_schema}.outbox_events o
          WHERE NOT EXISTS (SELECT 1 FROM {billing_schema}.billing_ledger l
                             WHERE l.message_id = o.id::text)
          ORDER BY o.created_at LIMIT 5"
    )))
    .fetch_all(pool)
    .await
    .unwrap_or_default();
    for id in &ids {
        let _ = writeln!(out, "event {id} has no effect");
        let rows: Vec<(String, i32, Option<String>, Option<String>)> =
            sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT status, attempts_made, locked_by, last_error
                   FROM {billing_schema}.inbox_events WHERE message_id = $1"
            )))
            .bind(id)
            .fetch_all(pool)
            .await
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "  inbox rows (status, attempts, locked_by, last_error): {rows:?}"
        );
        if let Ok(dir) = std::fs::read_dir(logs) {
            for e in dir.filter_map(|e| e.ok()) {
                let text = std::fs::read_to_string(e.path()).unwrap_or_default();
                for line in text.lines().filter(|l| l.contains(id.as_str())).take(20) {
                    let _ = writeln!(out, "  {}: {line}", e.file_name().to_string_lossy());
                }
            }
        }
    }
    #[cfg(feature = "redis")]
    if let Diagnose::Redis { stream, group } = diagnose {
        let _ = writeln!(out, "{}", redis_report(stream, group, &ids).await);
    }
    #[cfg(not(feature = "redis"))]
    let _ = diagnose;
    out
}

/// Where the stream entries of `ids` are: each entry carrying one, and whether it is pending
/// in `group` (under which consumer, delivered how often); the dead-letter stream's length.
#[cfg(feature = "redis")]
async fn redis_report(stream: &str, group: &str, ids: &[String]) -> String {
    use std::fmt::Write as _;
    let url = redis_url();
    let mut out = String::new();
    let Ok(client) = redis::Client::open(url) else {
        return "redis: cannot open the client".into();
    };
    let Ok(mut c) = client.get_multiplexed_async_connection().await else {
        return "redis: cannot connect".into();
    };
    let summary: redis::RedisResult<redis::Value> = redis::cmd("XPENDING")
        .arg(stream)
        .arg(group)
        .query_async(&mut c)
        .await;
    let _ = writeln!(out, "redis XPENDING {stream} {group}: {summary:?}");
    let groups: redis::RedisResult<redis::Value> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query_async(&mut c)
        .await;
    let _ = writeln!(out, "redis XINFO GROUPS: {groups:?}");
    let dl: redis::RedisResult<i64> = redis::cmd("XLEN")
        .arg(format!("{stream}:dead-letter"))
        .query_async(&mut c)
        .await;
    let _ = writeln!(out, "redis dead-letter entries: {dl:?}");
    type Entries = Vec<(String, Vec<(String, String)>)>;
    let all: redis::RedisResult<Entries> = redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .query_async(&mut c)
        .await;
    for (entry, fields) in all.unwrap_or_default() {
        if !fields
            .iter()
            .any(|(_, v)| ids.iter().any(|id| v.contains(id.as_str())))
        {
            continue;
        }
        let pending: redis::RedisResult<redis::Value> = redis::cmd("XPENDING")
            .arg(stream)
            .arg(group)
            .arg(&entry)
            .arg(&entry)
            .arg(1)
            .query_async(&mut c)
            .await;
        let _ = writeln!(
            out,
            "  entry {entry} (fields {fields:?}): pending {pending:?}"
        );
    }
    out
}

/// Two runners of one group on a topic of 4 partitions: each key's order is asserted too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_faults_kafka_two_runners_in_order() {
    trial(Kind::Kafka, Runners::TwoOfOneGroup).await;
}

/// Two runners competing on one quorum queue: every effect once, order reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_faults_rabbitmq_two_runners() {
    trial(Kind::Rabbitmq, Runners::TwoOfOneGroup).await;
}
