//! OP-09, the wake-up check through a transaction-pooling proxy (R195, R196), written once for
//! both stores: each store's test gives its listener ([`Op09Listener`]), a committed notifying
//! write and a way to read a row's status; [`op_09`] asserts the scenario. The warning and the
//! gauge are captured process-wide ([`capture`]): the listener logs and sets its gauge from a
//! task of its own, which no thread-local subscriber or recorder reaches.

use std::collections::HashMap;
use std::future::Future;
use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use futures::future::BoxFuture;
use metrics::{Counter, Gauge, GaugeFn, Histogram, Key, KeyName, Metadata, SharedString, Unit};
use tokio::sync::Notify;
use tokio::time::Instant;
use txoutbox_core::CancellationToken;
use txoutbox_core::broker::NoopBroker;
use txoutbox_core::relay::Relay;
use txoutbox_core::repository::OutboxRepository;
use txoutbox_postgres::wake::WAKEUP_LISTENER_OK;
use uuid::Uuid;

/// The warnings and gauges of this test process.
#[derive(Debug, Default)]
pub struct Capture {
    log: Arc<Mutex<Vec<u8>>>,
    gauges: Arc<Mutex<HashMap<String, f64>>>,
}

impl Capture {
    /// Lines logged at warn or above that contain `needle`.
    pub fn warnings(&self, needle: &str) -> Vec<String> {
        let log = self.log.lock().unwrap();
        String::from_utf8_lossy(&log)
            .lines()
            .filter(|l| l.contains(needle))
            .map(str::to_owned)
            .collect()
    }

    /// The last value of the gauge `name` with label `channel`.
    pub fn gauge(&self, name: &str, channel: &str) -> Option<f64> {
        self.gauges
            .lock()
            .unwrap()
            .get(&format!("{name}{{{channel}}}"))
            .copied()
    }
}

/// Installs (once per process) a global tracing subscriber that keeps warnings and errors, and
/// a global metrics recorder that keeps the gauges; returns what they captured.
pub fn capture() -> &'static Capture {
    static CAPTURE: OnceLock<Capture> = OnceLock::new();
    CAPTURE.get_or_init(|| {
        let c = Capture::default();
        let log = c.log.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_ansi(false)
            .with_writer(move || LogWriter(log.clone()))
            .finish();
        tracing::subscriber::set_global_default(subscriber)
            .expect("no other global subscriber in this test binary");
        metrics::set_global_recorder(Gauges(c.gauges.clone()))
            .expect("no other global recorder in this test binary");
        c
    })
}

struct LogWriter(Arc<Mutex<Vec<u8>>>);

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        std::io::stderr().write_all(buf)?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

struct Gauges(Arc<Mutex<HashMap<String, f64>>>);

struct GaugeCell {
    key: String,
    store: Arc<Mutex<HashMap<String, f64>>>,
}

impl GaugeFn for GaugeCell {
    fn increment(&self, v: f64) {
        *self
            .store
            .lock()
            .unwrap()
            .entry(self.key.clone())
            .or_default() += v;
    }
    fn decrement(&self, v: f64) {
        *self
            .store
            .lock()
            .unwrap()
            .entry(self.key.clone())
            .or_default() -= v;
    }
    fn set(&self, v: f64) {
        self.store.lock().unwrap().insert(self.key.clone(), v);
    }
}

impl metrics::Recorder for Gauges {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
        Counter::noop()
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        let channel = key
            .labels()
            .find(|l| l.key() == "channel")
            .map(|l| l.value().to_owned())
            .unwrap_or_default();
        Gauge::from_arc(Arc::new(GaugeCell {
            key: format!("{}{{{channel}}}", key.name()),
            store: self.0.clone(),
        }))
    }
    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

/// A running listener of the store under test.
pub struct Op09Listener {
    /// The channel it listens on.
    pub channel: String,
    /// Its `listener_ok()`.
    pub ok: Box<dyn Fn() -> Option<bool> + Send + Sync>,
    /// The listener itself (dropping it stops it).
    pub keep: Box<dyn std::any::Any + Send>,
}

/// What the warning of R196 says (a part of it).
pub const SILENT_WARNING: &str = "did not arrive";

async fn within<F: Fn() -> bool>(limit: Duration, what: &str, ok: F) -> Duration {
    let t0 = Instant::now();
    while !ok() {
        assert!(t0.elapsed() <= limit, "not within {limit:?}: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    t0.elapsed()
}

/// OP-09. `spawn(direct, wakers)` starts the store's listener: LISTENing through the
/// transaction-pooling proxy (`direct = false`, no listen_url) or on a direct listen_url, its
/// probe through the proxy; `repo` is the store's repository through the proxy;
/// `write` commits one notifying write and returns its id; `status` reads a row's status.
/// Expected: through the proxy, within 3 s the warning and the gauge 0, and a committed event
/// published within 1 s by the fallback polling (the relay's own poll interval is 60 s); with
/// a direct listen_url, the gauge 1 and no warning.
pub async fn op_09<S, W, WF, P, PF>(repo: Arc<dyn OutboxRepository>, spawn: S, write: W, status: P)
where
    S: Fn(bool, Vec<Arc<Notify>>) -> BoxFuture<'static, Op09Listener>,
    W: Fn() -> WF,
    WF: Future<Output = Uuid>,
    P: Fn(Uuid) -> PF,
    PF: Future<Output = String>,
{
    let cap = capture();
    let relay = Relay::builder(repo, Arc::new(NoopBroker))
        .poll_interval(Duration::from_secs(60))
        .build()
        .expect("relay");
    let relay = Arc::new(relay);
    let stop = CancellationToken::new();
    let running = tokio::spawn({
        let (relay, stop) = (relay.clone(), stop.clone());
        async move { relay.run(stop).await }
    });

    // First a direct listen_url: probes arrive, the gauge is 1, nothing is logged. (It goes
    // first: the LISTEN through the proxy below leaves its server connection listening after
    // the listener is gone, and a probe of a later listener that PgBouncer sends over that
    // connection fails on the notification it finds there.)
    let direct = spawn(true, vec![relay.waker()]).await;
    let ch = direct.channel.clone();
    within(
        Duration::from_secs(3),
        "the gauge 1 with a direct listen_url",
        || (direct.ok)() == Some(true) && cap.gauge(WAKEUP_LISTENER_OK, &ch) == Some(1.0),
    )
    .await;
    assert_eq!(
        cap.warnings(&ch).len(),
        0,
        "no warning with a direct listen_url: {:?}",
        cap.warnings(&ch)
    );
    drop(direct);

    // Through the proxy: LISTEN succeeds and delivers nothing.
    let silent = spawn(false, vec![relay.waker()]).await;
    assert_eq!(silent.channel, ch, "one table, one channel");
    let took = within(
        Duration::from_secs(3),
        "the warning and the gauge 0",
        || {
            !cap.warnings(&ch)
                .iter()
                .all(|l| !l.contains(SILENT_WARNING))
                && cap.gauge(WAKEUP_LISTENER_OK, &ch) == Some(0.0)
                && (silent.ok)() == Some(false)
        },
    )
    .await;
    eprintln!("OP-09: warning and gauge 0 after {took:?}");
    let warning = cap
        .warnings(&ch)
        .into_iter()
        .find(|l| l.contains(SILENT_WARNING))
        .unwrap();
    assert!(
        warning.contains("transaction-pooling proxy") && warning.contains("listen_url"),
        "the warning names the cause and the remedy: {warning}"
    );

    // The relay, idle with a 60 s poll interval, publishes by the fallback polling.
    let id = write().await;
    let t0 = Instant::now();
    loop {
        if status(id).await == "completed" {
            break;
        }
        assert!(
            t0.elapsed() <= Duration::from_secs(1),
            "the committed event was not published within 1 s by the fallback polling"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("OP-09: published after {:?}", t0.elapsed());
    drop(silent);

    stop.cancel();
    running.await.expect("relay task").expect("relay run");
}
