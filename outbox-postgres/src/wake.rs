//! The wake-up listener, shared by the drivers: a task that LISTENs on an outbox table's
//! channel, wakes relays on each notification, checks that notifications arrive at all (R196),
//! and reconnects. Each driver supplies its half ([`WakeSource`]: connect and LISTEN, then
//! hand over each notification's payload); the probe goes through the store ([`StoreProbe`]);
//! this module owns the loop.
//!
//! # Reconnecting
//!
//! When the listening connection is lost (server restart, `pg_terminate_backend`), the listener
//! connects again with a back-off ([`RECONNECT_MIN`] doubling to [`RECONNECT_MAX`]) and, once
//! LISTEN is back, wakes every relay once: notifications sent meanwhile are lost, and the extra
//! cycle picks up their rows. Until then the relays poll.
//!
//! # The wake-up check (R196, scenario OP-09)
//!
//! A LISTEN through a transaction-pooling proxy (PgBouncer `pool_mode = transaction`) succeeds
//! and then never delivers. So after LISTEN succeeds, and again whenever
//! [`WakeCheck::notify_check_interval`] passes without a notification, the listener sends one
//! NOTIFY on its channel whose payload starts with [`PROBE_PREFIX`], in a transaction of its
//! store, and waits up to [`WakeCheck::probe_wait`] from that commit (start-up does not wait).
//! If it does not arrive: one warning naming the likely cause, the gauge
//! [`WAKEUP_LISTENER_OK`] = 0, and the relays are woken every
//! [`WakeCheck::fallback_poll_interval`] instead of waiting for their poll interval, until a
//! probe arrives again (gauge 1, the warning not repeated). A probe, this listener's or
//! another's, wakes no relay.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::driver::{Bind, Connection, Driver, finish};
use crate::error::Error;
use crate::sql::{Pooler, Statements, TableName};

/// First wait before connecting the listener again; it doubles up to [`RECONNECT_MAX`].
pub const RECONNECT_MIN: Duration = Duration::from_millis(100);
/// Longest wait between two attempts to connect the listener again.
pub const RECONNECT_MAX: Duration = Duration::from_secs(5);

/// How a probe's payload starts (R196): `txoutbox-probe:{process}:{listener}:{n}`.
pub const PROBE_PREFIX: &str = "txoutbox-probe:";

/// The gauge of the wake-up check (R196): 1 while probes arrive, 0 once one did not (label
/// `channel`).
pub const WAKEUP_LISTENER_OK: &str = "outbox_wakeup_listener_ok";

/// The settings of the wake-up check (R196).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WakeCheck {
    notify_check_interval: Duration,
    probe_wait: Duration,
    fallback_poll_interval: Duration,
}

impl Default for WakeCheck {
    fn default() -> Self {
        Self {
            notify_check_interval: Duration::from_secs(60),
            probe_wait: Duration::from_secs(2),
            fallback_poll_interval: Duration::from_millis(500),
        }
    }
}

impl WakeCheck {
    /// A probe is sent after LISTEN succeeds and whenever this much time passes without a
    /// notification (default 60 s, at least 1 s).
    pub fn notify_check_interval(mut self, d: Duration) -> Result<Self, Error> {
        if d < Duration::from_secs(1) {
            return Err(Error::Config(format!(
                "notify_check_interval must be at least 1s, got {d:?}"
            )));
        }
        self.notify_check_interval = d;
        Ok(self)
    }

    /// How long after its commit a probe may take to arrive (default 2 s, more than zero).
    pub fn probe_wait(mut self, d: Duration) -> Result<Self, Error> {
        if d.is_zero() {
            return Err(Error::Config("probe_wait must be more than zero".into()));
        }
        self.probe_wait = d;
        Ok(self)
    }

    /// How often the relays are woken while probes do not arrive (default 500 ms, at least
    /// 10 ms).
    pub fn fallback_poll_interval(mut self, d: Duration) -> Result<Self, Error> {
        if d < Duration::from_millis(10) {
            return Err(Error::Config(format!(
                "fallback_poll_interval must be at least 10ms, got {d:?}"
            )));
        }
        self.fallback_poll_interval = d;
        Ok(self)
    }

    /// The configured check interval.
    pub fn check_interval(&self) -> Duration {
        self.notify_check_interval
    }

    /// The configured fallback poll interval.
    pub fn fallback_interval(&self) -> Duration {
        self.fallback_poll_interval
    }
}

/// What a wake-up listener is given beyond its pool and table: where to LISTEN (R195), the
/// store's pooler mode for the probe's transaction (R194), and the check's settings (R196).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WakeOptions {
    listen_url: Option<String>,
    pooler: Pooler,
    check: WakeCheck,
}

impl WakeOptions {
    /// LISTEN on a connection of its own to this URL (R195) instead of the store's database
    /// URL or pool. Notifications cannot pass a transaction-pooling proxy: behind one, give a
    /// direct URL here.
    pub fn listen_url(mut self, url: impl Into<String>) -> Self {
        self.listen_url = Some(url.into());
        self
    }

    /// The store's pooler mode: the probe runs in a transaction of the store, marked like its
    /// other statements (default [`Pooler::None`]).
    pub fn pooler(mut self, pooler: Pooler) -> Self {
        self.pooler = pooler;
        self
    }

    /// The wake-up check's settings (default [`WakeCheck::default`]).
    pub fn check(mut self, check: WakeCheck) -> Self {
        self.check = check;
        self
    }

    /// The URL to LISTEN on, when one was given.
    pub fn listen_url_ref(&self) -> Option<&str> {
        self.listen_url.as_deref()
    }

    /// The probe of `driver` for `table` in the pooler mode given.
    pub fn probe<D: Driver>(&self, driver: D, table: &TableName) -> StoreProbe<D> {
        StoreProbe::new(driver, &Statements::new(table).for_pooler(self.pooler))
    }

    /// The check's settings.
    pub fn check_ref(&self) -> WakeCheck {
        self.check
    }
}

/// A driver's half of the listener (semver-exempt, like [`crate::driver`]).
#[async_trait]
pub trait WakeSource: Send + Sync + 'static {
    /// A connection LISTENing on the channel.
    type Conn: Send;

    /// Connects (a connection of its own, outside any pool) and LISTENs on `channel`.
    async fn listen(&self, channel: &str) -> Result<Self::Conn, String>;

    /// Calls `note` with each notification's payload until the connection is lost; returns
    /// `None` when it closed, or the error that ended it.
    async fn until_lost(
        &self,
        conn: &mut Self::Conn,
        note: &(dyn for<'p> Fn(&'p str) + Sync),
    ) -> Option<String>;
}

/// Sends the wake-up check's probe (semver-exempt): one NOTIFY in a transaction of the store.
#[async_trait]
pub trait ProbeSender: Send + Sync + 'static {
    /// Sends `payload` on `channel` and returns once its transaction committed.
    async fn probe(&self, channel: &str, payload: &str) -> Result<(), String>;
}

/// The probe of any driver: [`Statements::notify_probe`] in a transaction of the store's
/// pool (marked for its pooler mode, R194, like every statement of the set).
#[derive(Debug, Clone)]
pub struct StoreProbe<D> {
    driver: D,
    table: TableName,
    sql: String,
}

impl<D: Driver> StoreProbe<D> {
    /// The probe through `driver` with the statements of the store.
    pub fn new(driver: D, stmts: &Statements) -> Self {
        Self {
            driver,
            table: stmts.table.clone(),
            sql: stmts.notify_probe.clone(),
        }
    }
}

#[async_trait]
impl<D: Driver> ProbeSender for StoreProbe<D> {
    async fn probe(&self, channel: &str, payload: &str) -> Result<(), String> {
        let mut tx = self
            .driver
            .begin(&self.table)
            .await
            .map_err(|e| e.to_string())?;
        let r = tx
            .execute(
                &self.sql,
                vec![
                    Bind::Text(channel.to_owned()),
                    Bind::Text(payload.to_owned()),
                ],
            )
            .await
            .map_err(|e| D::Conn::map_err(&self.table, e));
        finish::<D, u64>(&self.table, tx, r)
            .await
            .map(drop)
            .map_err(|e| e.to_string())
    }
}

const UNKNOWN: u8 = 0;
const OK: u8 = 1;
const FAILED: u8 = 2;

static LISTENERS: AtomicU64 = AtomicU64::new(0);

/// The running listener task; dropping it stops the task.
#[derive(Debug)]
pub struct Listening {
    task: JoinHandle<()>,
    channel: String,
    health: Arc<AtomicU8>,
}

impl Listening {
    /// Connects and LISTENs on `channel` with `source`, then runs the loop (and the wake-up
    /// check, probing with `probe`) in a task. Returns once LISTEN is in place, so a
    /// notification committed after this returns is seen; fails with the driver's message
    /// when the first connection or LISTEN fails. Does not wait for the first probe.
    pub async fn spawn<S: WakeSource, P: ProbeSender>(
        source: S,
        probe: P,
        channel: String,
        wakers: Vec<Arc<Notify>>,
        check: WakeCheck,
    ) -> Result<Self, String> {
        let conn = source.listen(&channel).await?;
        tracing::debug!(%channel, "listening for wake-ups");
        let health = Arc::new(AtomicU8::new(UNKNOWN));
        let id = LISTENERS.fetch_add(1, Ordering::Relaxed);
        let shared = Shared {
            channel: channel.clone(),
            own: format!("{PROBE_PREFIX}{}:{id}:", std::process::id()),
            wakers,
            health: health.clone(),
            arrived: watch::channel(0).0,
            last_note: Mutex::new(Instant::now()),
            check,
        };
        let task = tokio::spawn(run(source, probe, conn, shared));
        Ok(Self {
            task,
            channel,
            health,
        })
    }

    /// The channel listened on.
    pub fn channel(&self) -> &str {
        &self.channel
    }

    /// What the wake-up check found (R196): `None` before the first probe's answer, then
    /// whether the last probe arrived (the value of [`WAKEUP_LISTENER_OK`]).
    pub fn listener_ok(&self) -> Option<bool> {
        match self.health.load(Ordering::Acquire) {
            OK => Some(true),
            FAILED => Some(false),
            _ => None,
        }
    }
}

impl Drop for Listening {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Shared {
    channel: String,
    /// This listener's probe payloads start with this.
    own: String,
    wakers: Vec<Arc<Notify>>,
    health: Arc<AtomicU8>,
    /// The number of this listener's last probe that arrived.
    arrived: watch::Sender<u64>,
    last_note: Mutex<Instant>,
    check: WakeCheck,
}

impl Shared {
    fn wake_all(&self) {
        self.wakers.iter().for_each(|w| w.notify_one());
    }

    /// One notification: a probe wakes no relay; this listener's own marks its arrival.
    fn note(&self, payload: &str) {
        *self.last_note.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        if let Some(n) = payload.strip_prefix(&self.own) {
            if let Ok(n) = n.parse::<u64>() {
                self.arrived.send_if_modified(|a| {
                    let newer = n > *a;
                    if newer {
                        *a = n;
                    }
                    newer
                });
            }
            return;
        }
        if payload.starts_with(PROBE_PREFIX) {
            return;
        }
        self.wake_all();
    }

    fn set_health(&self, ok: bool) {
        let was = self
            .health
            .swap(if ok { OK } else { FAILED }, Ordering::AcqRel);
        metrics::gauge!(WAKEUP_LISTENER_OK, "channel" => self.channel.clone()).set(if ok {
            1.0
        } else {
            0.0
        });
        let channel = &self.channel;
        match (was, ok) {
            (FAILED, true) => tracing::info!(
                %channel,
                "the wake-up probe arrived again: LISTEN delivers, the relays are back on their poll interval"
            ),
            (OK | UNKNOWN, false) => tracing::warn!(
                %channel,
                probe_wait = ?self.check.probe_wait,
                fallback_poll_interval = ?self.check.fallback_poll_interval,
                "the wake-up probe (a NOTIFY on the listener's own channel) did not arrive: LISTEN succeeded but delivers nothing, most likely because a transaction-pooling proxy (PgBouncer pool_mode = transaction) stands between the listener and PostgreSQL; give the listener a direct connection (listen_url, --listen-url). Until a probe arrives, the relays poll every fallback_poll_interval"
            ),
            _ => {}
        }
    }

    /// The wake-up check: a probe now, then whenever the check interval passes without a
    /// notification; the fallback wake-ups while probes do not arrive. Runs until dropped.
    async fn check<P: ProbeSender>(&self, probe: &P) -> Infallible {
        let mut rx = self.arrived.subscribe();
        let mut n = *rx.borrow();
        loop {
            n += 1;
            let payload = format!("{}{n}", self.own);
            let sent = match probe.probe(&self.channel, &payload).await {
                Ok(()) => {
                    let wait =
                        tokio::time::timeout(self.check.probe_wait, rx.wait_for(|a| *a >= n));
                    matches!(wait.await, Ok(Ok(_)))
                }
                Err(e) => {
                    tracing::warn!(channel = %self.channel, error = %e, "could not send the wake-up probe; checking again after notify_check_interval");
                    false
                }
            };
            self.set_health(sent);
            let probed_at = Instant::now();
            // Until the next probe is due: the fallback wake-ups while the check fails.
            loop {
                let last = *self.last_note.lock().unwrap_or_else(|e| e.into_inner());
                let due = last.max(probed_at) + self.check.notify_check_interval;
                if Instant::now() >= due {
                    break;
                }
                if self.health.load(Ordering::Acquire) == FAILED {
                    tokio::time::sleep(self.check.fallback_poll_interval.min(due - Instant::now()))
                        .await;
                    self.wake_all();
                } else {
                    tokio::time::sleep_until(due).await;
                }
            }
        }
    }
}

async fn run<S: WakeSource, P: ProbeSender>(source: S, probe: P, mut conn: S::Conn, me: Shared) {
    let channel = me.channel.clone();
    loop {
        let note = |payload: &str| me.note(payload);
        let lost = tokio::select! {
            lost = source.until_lost(&mut conn, &note) => lost,
            never = me.check(&probe) => match never {},
        };
        match lost {
            None => {
                tracing::warn!(%channel, "LISTEN connection lost; reconnecting (the relays poll meanwhile)");
            }
            Some(e) => {
                tracing::warn!(%channel, error = %e, "LISTEN connection failed; reconnecting (the relays poll meanwhile)");
            }
        }
        drop(conn);
        let mut wait = RECONNECT_MIN;
        conn = loop {
            match source.listen(&channel).await {
                Ok(c) => break c,
                Err(e) => {
                    tracing::debug!(%channel, error = %e, retry_in = ?wait, "LISTEN reconnect failed");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(RECONNECT_MAX);
                }
            }
        };
        tracing::info!(%channel, "LISTEN connection back; waking the relays once for what was missed");
        *me.last_note.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        me.wake_all();
    }
}

#[cfg(test)]
mod tests {
    //! The wake-up check's timing on paused tokio time, with a fake LISTEN connection whose
    //! deliveries the test switches on and off (the real proxy is OP-09's, tests/pooler.rs).
    use std::sync::atomic::AtomicBool;

    use tokio::sync::mpsc;

    use super::*;

    type Bus = mpsc::UnboundedSender<String>;

    struct FakeSource(Mutex<Option<mpsc::UnboundedReceiver<String>>>);

    #[async_trait]
    impl WakeSource for FakeSource {
        type Conn = mpsc::UnboundedReceiver<String>;
        async fn listen(&self, _: &str) -> Result<Self::Conn, String> {
            self.0
                .lock()
                .unwrap()
                .take()
                .ok_or_else(|| "gone".to_owned())
        }
        async fn until_lost(
            &self,
            rx: &mut Self::Conn,
            note: &(dyn for<'p> Fn(&'p str) + Sync),
        ) -> Option<String> {
            while let Some(p) = rx.recv().await {
                note(&p);
            }
            None
        }
    }

    struct FakeProbe {
        bus: Bus,
        deliver: Arc<AtomicBool>,
        sent: Arc<AtomicU64>,
    }

    #[async_trait]
    impl ProbeSender for FakeProbe {
        async fn probe(&self, _: &str, payload: &str) -> Result<(), String> {
            self.sent.fetch_add(1, Ordering::SeqCst);
            if self.deliver.load(Ordering::SeqCst) {
                let bus = self.bus.clone();
                let payload = payload.to_owned();
                // Delivered 50 ms after the commit.
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    let _ = bus.send(payload);
                });
            }
            Ok(())
        }
    }

    async fn woken_within(n: &Notify, d: Duration) -> bool {
        tokio::time::timeout(d, n.notified()).await.is_ok()
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_listen_is_found_polled_around_and_recovered() {
        let (bus, rx) = mpsc::unbounded_channel();
        let deliver = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let waker = Arc::new(Notify::new());
        let probe = FakeProbe {
            bus: bus.clone(),
            deliver: deliver.clone(),
            sent: sent.clone(),
        };
        let l = Listening::spawn(
            FakeSource(Mutex::new(Some(rx))),
            probe,
            "outbox.t".into(),
            vec![waker.clone()],
            WakeCheck::default(),
        )
        .await
        .unwrap();
        // Start-up does not wait for the probe; its answer is due within 2 s of the commit.
        assert_eq!(l.listener_ok(), None);
        tokio::time::sleep(Duration::from_millis(1990)).await;
        assert_eq!(l.listener_ok(), None, "not before the probe wait is over");
        assert_eq!(sent.load(Ordering::SeqCst), 1, "one probe after LISTEN");
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(
            l.listener_ok(),
            Some(false),
            "the probe did not arrive within 2 s"
        );

        // Fallback polling: a wake-up every 500 ms.
        let t0 = Instant::now();
        for _ in 0..4 {
            assert!(woken_within(&waker, Duration::from_millis(510)).await);
        }
        let took = t0.elapsed();
        assert!(
            took >= Duration::from_millis(1400) && took <= Duration::from_millis(2100),
            "four fallback wake-ups took {took:?}"
        );

        // Deliveries work again: the next probe, due 60 s after the last one's answer was
        // given up (t = 2 s; now t is about 4 s), arrives.
        deliver.store(true, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(55)).await;
        assert_eq!(l.listener_ok(), Some(false));
        assert_eq!(sent.load(Ordering::SeqCst), 1);
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(
            sent.load(Ordering::SeqCst),
            2,
            "the second probe after 60 s"
        );
        assert_eq!(l.listener_ok(), Some(true), "the probe arrived: back to ok");

        // Healthy: no fallback wake-ups, a probe (this listener's or another's) wakes no
        // loop, a writer's notification does. (First the permit the last fallback wake-up left.)
        let _ = woken_within(&waker, Duration::from_millis(1)).await;
        assert!(!woken_within(&waker, Duration::from_secs(5)).await);
        bus.send(format!("{PROBE_PREFIX}4242:0:1")).unwrap();
        assert!(!woken_within(&waker, Duration::from_secs(1)).await);
        bus.send(String::new()).unwrap();
        assert!(woken_within(&waker, Duration::from_millis(10)).await);

        // Notifications keep the check quiet: none for 60 s, then a probe.
        let before = sent.load(Ordering::SeqCst);
        for _ in 0..3 {
            tokio::time::sleep(Duration::from_secs(30)).await;
            bus.send(String::new()).unwrap();
            assert!(woken_within(&waker, Duration::from_millis(10)).await);
        }
        assert_eq!(
            sent.load(Ordering::SeqCst),
            before,
            "no probe while notifications arrive"
        );
        tokio::time::sleep(Duration::from_secs(61)).await;
        assert_eq!(sent.load(Ordering::SeqCst), before + 1);
    }

    #[test]
    fn settings_are_bounded() {
        let c = WakeCheck::default();
        assert!(c.notify_check_interval(Duration::from_millis(999)).is_err());
        assert!(c.fallback_poll_interval(Duration::from_millis(9)).is_err());
        assert!(c.probe_wait(Duration::ZERO).is_err());
        assert_eq!(c.check_interval(), Duration::from_secs(60));
        assert_eq!(c.fallback_interval(), Duration::from_millis(500));
    }
}
