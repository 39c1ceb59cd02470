//! P: pipeline stop, circuit breaker, terminal failures, commit failure; M: operator visibility
//! and hooks.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use txoutbox_core::error::StepError;
use txoutbox_core::event::{OutboxEvent, Status};
use txoutbox_core::relay::{BreakerConfig, RowOutcome};
use txoutbox_core::repository::OutboxRepository;
use txoutbox_core::scripted::Action;
use txoutbox_core::step::{ObservedOutcome, PipelineStep, StepDecision};
use uuid::Uuid;

use crate::ctx::{Cfg, Ctx};
use crate::harness::{Factory, RowPatch};

/// One observed outcome: id, outcome, publish duration, the row as stored when observed.
type Seen = (Uuid, RowOutcome, Option<Duration>, Option<OutboxEvent>);

/// Records what the relay's observers were called with.
#[derive(Default)]
struct Recorder {
    fetches: Mutex<Vec<usize>>,
    outcomes: Mutex<Vec<Seen>>,
    terminal: Mutex<Vec<(OutboxEvent, String, Option<OutboxEvent>)>>,
    repo: Mutex<Option<Arc<dyn OutboxRepository>>>,
    panic_first_completion: Mutex<bool>,
}

#[async_trait]
impl PipelineStep for Recorder {
    async fn on_fetch(&self, rows: usize) {
        self.fetches.lock().unwrap().push(rows);
    }
    async fn on_outcome(&self, o: &ObservedOutcome<'_>) {
        let repo = self.repo.lock().unwrap().clone();
        let stored = match repo {
            Some(r) => r.get(o.event.id).await.unwrap(),
            None => None,
        };
        self.outcomes
            .lock()
            .unwrap()
            .push((o.event.id, o.outcome.clone(), o.duration, stored));
        if matches!(o.outcome, RowOutcome::Completed { .. }) {
            let mut p = self.panic_first_completion.lock().unwrap();
            if *p {
                *p = false;
                drop(p);
                panic!("observer panics on purpose (M-03)");
            }
        }
    }
    async fn on_terminal_failure(&self, e: &OutboxEvent, error: &str) {
        let repo = self.repo.lock().unwrap().clone();
        let stored = match repo {
            Some(r) => r.get(e.id).await.unwrap(),
            None => None,
        };
        self.terminal
            .lock()
            .unwrap()
            .push((e.clone(), error.to_owned(), stored));
    }
}

/// P-02 The circuit breaker releases, then stops fetching.
pub async fn p_02(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e = c
        .puts(&["k1", "k2", "k3", "k4", "k5", "k6", "k7", "k8"])
        .await;
    c.broker.set_default(Action::Reject("no".into()));
    let rec = Arc::new(Recorder::default());
    let mut cfg = Cfg::default().step(rec.clone());
    cfg.breaker = Some(BreakerConfig::new(3, 60.0).unwrap());
    let relay = c.relay(&cfg);
    let before: Vec<OutboxEvent> =
        futures::future::join_all(e[3..].iter().map(|id| c.get(*id))).await;
    let c1 = c.run(&relay).await;
    assert_eq!(c1.report.counted.len(), 3);
    assert_eq!(c1.report.released.len(), 5);
    for b in &before {
        c.assert_untouched(b).await;
    }
    let calls = c.broker.calls().len();
    let c2 = c.run(&relay).await;
    assert!(c2.report.fetched.is_empty());
    assert_eq!(
        *rec.fetches.lock().unwrap(),
        vec![8],
        "the fetch hook ran while the breaker was open"
    );
    assert_eq!(c.broker.calls().len(), calls);
    c.advance(Duration::from_secs(61)).await;
    let c3 = c.run(&relay).await;
    assert_eq!(c3.report.fetched.len(), 8);
    assert_eq!(c.broker.calls().len(), calls + 1);
    assert_eq!(c3.report.counted.len(), 1);
    assert_eq!(c3.report.released.len(), 7);
    assert!(c3.report.breaker_open);
    assert!(BreakerConfig::new(0, 60.0).is_err());
    assert!(BreakerConfig::new(3, -1.0).is_err());
}

/// P-09 A success closes the circuit breaker and resets its count (R62).
pub async fn p_09(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e = c
        .puts(&["k1", "k2", "k3", "k4", "k5", "k6", "k7", "k8"])
        .await;
    for id in [e[0], e[1], e[2], e[5], e[6]] {
        c.broker.script(id, [Action::Reject("no".into())]);
    }
    let cfg = Cfg {
        breaker: Some(BreakerConfig::new(3, 60.0).unwrap()),
        ..Cfg::default()
    };
    let relay = c.relay(&cfg);
    let c1 = c.run(&relay).await;
    assert_eq!(c1.report.counted.len(), 3);
    assert!(c1.report.breaker_open);
    c.advance(Duration::from_secs(61)).await;
    // Half-open: e4 (the oldest due head) is acknowledged, which closes the breaker and resets
    // the count, so the two rejections that follow (e6, e7) do not open it again.
    let c2 = c.run(&relay).await;
    // Heads in scheduled_at order: the five never tried first, then the three retries.
    assert_eq!(c2.report.fetched[..5], e[3..]);
    let mut retried = c2.report.fetched[5..].to_vec();
    retried.sort();
    let mut want = e[..3].to_vec();
    want.sort();
    assert_eq!(retried, want);
    assert_eq!(
        c2.report.counted.len(),
        2,
        "P-09: a success closes the breaker and resets its count (R62), so two later \
         rejections do not open it again\n{:?}",
        c2.report
    );
    assert_eq!(c2.report.completed.len(), 6, "{:?}", c2.report);
    assert!(
        !c2.report.breaker_open,
        "the breaker is still open after a success"
    );
    let f1 = c.put(c.ev("k9")).await;
    let c3 = c.run(&relay).await;
    assert!(!c3.report.breaker_open);
    assert_eq!(c3.sent, vec![f1]);
}

/// P-03 A terminal failure is reported after the commit.
pub async fn p_03(f: &dyn Factory) {
    for fail_commit in [false, true] {
        let c = Ctx::new(f).await;
        let d1 = c.put(c.ev("k1").max_attempts(2)).await;
        let d2 = c.put(c.ev("k2").max_attempts(2)).await;
        c.set(
            d1,
            RowPatch {
                attempts_made: Some(1),
                ..RowPatch::default()
            },
        )
        .await;
        c.broker.set_default(Action::Reject("x".into()));
        let rec = Arc::new(Recorder::default());
        *rec.repo.lock().unwrap() = Some(c.repo());
        if fail_commit {
            c.h.fail_next_outcome_commit();
        }
        c.cycle(&Cfg::default().base(0.0).step(rec.clone())).await;
        let t = rec.terminal.lock().unwrap().clone();
        if fail_commit {
            assert!(t.is_empty(), "terminal hook ran although the commit failed");
            continue;
        }
        assert_eq!(t.len(), 1);
        let (before, error, stored) = &t[0];
        assert_eq!((before.id, before.attempts_made), (d1, 1));
        assert_eq!(error, "x");
        let stored = stored.as_ref().unwrap();
        assert_eq!((stored.status, stored.attempts_made), (Status::Failed, 2));
        c.assert_state(d2, Status::Pending, 1).await;
    }
}

/// P-06 Commit failure.
pub async fn p_06(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e = c.puts(&["k1", "k2", "k3"]).await;
    c.h.fail_next_outcome_commit();
    let c1 = c.cycle1().await;
    assert!(c1.report.commit_failed);
    assert_eq!(c1.report.completed.len(), 3);
    for id in &e {
        let r = c.get(*id).await;
        assert_eq!((r.status, r.attempts_made), (Status::Pending, 0));
        assert_eq!(r.locked_by.as_deref(), Some("w1"));
    }
    c.advance(Duration::from_secs(301)).await;
    let c2 = c.cycle1().await;
    assert_eq!(c2.sent, e);
}

struct StopAt(Uuid);

#[async_trait]
impl PipelineStep for StopAt {
    async fn before_publish(&self, e: &OutboxEvent) -> Result<StepDecision, StepError> {
        Ok(if e.id == self.0 {
            StepDecision::StopCycle
        } else {
            StepDecision::Continue
        })
    }
}

/// P-07 A step that stops the cycle.
pub async fn p_07(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e = c.puts(&["k1", "k2", "k3"]).await;
    let before = [c.get(e[1]).await, c.get(e[2]).await];
    let c1 = c.cycle(&Cfg::default().step(Arc::new(StopAt(e[1])))).await;
    assert_eq!(c1.sent, vec![e[0]]);
    c.assert_state(e[0], Status::Completed, 0).await;
    for b in &before {
        c.assert_untouched(b).await;
    }
}

/// M-01 Blocked keys.
pub async fn m_01(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let a = c.puts(&["k1", "k1", "k1"]).await;
    let b = c.puts(&["k2", "k2"]).await;
    c.puts(&["k3"]).await;
    c.put(c.ev("k4").delay(Duration::from_secs(3600))).await;
    c.puts(&["k4"]).await;
    let e1 = c.put(c.ev("k5")).await;
    let now = c.now().await;
    let a1_next = now + chrono::Duration::seconds(8);
    c.set(
        a[0],
        RowPatch {
            attempts_made: Some(1),
            last_error: Some(Some("bad".into())),
            scheduled_at: Some(a1_next),
            ..RowPatch::default()
        },
    )
    .await;
    c.set(b[0], RowPatch::held("w2", now)).await;
    c.set(
        e1,
        RowPatch::held("w9", now - chrono::Duration::seconds(301)),
    )
    .await;
    let bk = c
        .repo()
        .blocked_keys(Duration::from_secs(300), 100)
        .await
        .unwrap();
    assert_eq!(bk.len(), 2, "{bk:?}");
    let k1 = &bk[0];
    assert_eq!((k1.partition_key.as_str(), k1.head_id), ("k1", a[0]));
    assert_eq!((k1.attempts_made, k1.max_attempts), (1, 6));
    assert_eq!(k1.last_error.as_deref(), Some("bad"));
    assert_eq!(k1.next_try, c.get(a[0]).await.scheduled_at);
    assert!(k1.locked_by.is_none());
    assert_eq!(k1.waiting, 2);
    let k2 = &bk[1];
    assert_eq!(
        (k2.partition_key.as_str(), k2.head_id, k2.attempts_made),
        ("k2", b[0], 0)
    );
    assert!(k2.last_error.is_none());
    assert_eq!(k2.locked_by.as_deref(), Some("w2"));
    assert_eq!(k2.locked_at, c.get(b[0]).await.locked_at);
    assert_eq!(k2.waiting, 1);
}

/// M-02 Counts and the oldest due row.
pub async fn m_02(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    c.put(c.ev("p1").topic("t1")).await;
    c.put(c.ev("p2").topic("t1")).await;
    let c1 = c.put(c.ev("c1").topic("t1")).await;
    let f1 = c.put(c.ev("f1").topic("t2")).await;
    c.put(c.ev("d1").topic("t2").delay(Duration::from_secs(3600)))
        .await;
    let now = c.now().await;
    // The completed and the failed row were scheduled an hour ago: older than every pending row,
    // but not due pending rows, so they count for nothing in the oldest due age (R80).
    let long_ago = now - chrono::Duration::hours(1);
    c.set(
        c1,
        RowPatch {
            status: Some(Status::Completed),
            completed_at: Some(Some(now)),
            scheduled_at: Some(long_ago),
            ..RowPatch::default()
        },
    )
    .await;
    c.set(
        f1,
        RowPatch {
            status: Some(Status::Failed),
            attempts_made: Some(6),
            scheduled_at: Some(long_ago),
            ..RowPatch::default()
        },
    )
    .await;
    c.advance(Duration::from_secs(30)).await;
    let counts: Vec<(String, Status, i64)> = c
        .repo()
        .counts()
        .await
        .unwrap()
        .into_iter()
        .map(|s| (s.topic, s.status, s.count))
        .collect();
    for want in [
        ("t1".to_string(), Status::Pending, 2),
        ("t1".to_string(), Status::Completed, 1),
        ("t2".to_string(), Status::Failed, 1),
        ("t2".to_string(), Status::Pending, 1),
    ] {
        assert!(counts.contains(&want), "{want:?} not in {counts:?}");
    }
    assert_eq!(counts.len(), 4);
    let age = c.repo().oldest_due_age().await.unwrap().expect("a due row");
    let tol = if c.clock_stands_still() { 0.001 } else { 2.0 };
    assert!(
        (age.as_secs_f64() - 30.0).abs() <= tol,
        "M-02: oldest due age {age:?}, expected 30 s: only due pending rows count (R80)"
    );
    let fresh = Ctx::new(f).await;
    fresh
        .put(fresh.ev("d1").delay(Duration::from_secs(3600)))
        .await;
    assert_eq!(fresh.repo().oldest_due_age().await.unwrap(), None);
}

mod spans {
    use std::sync::{Arc, Mutex};
    use tracing::field::{Field, Visit};
    use tracing::span::{Attributes, Id, Record};
    use tracing_subscriber::layer::{Context, Layer};

    #[derive(Debug, Clone, Default)]
    pub struct Span {
        pub name: String,
        pub fields: Vec<(String, String)>,
    }

    impl Span {
        pub fn get(&self, k: &str) -> Option<&str> {
            self.fields
                .iter()
                .rev()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.as_str())
        }
    }

    struct V<'a>(&'a mut Vec<(String, String)>);
    impl Visit for V<'_> {
        fn record_debug(&mut self, f: &Field, v: &dyn std::fmt::Debug) {
            self.0.push((f.name().to_owned(), format!("{v:?}")));
        }
        fn record_str(&mut self, f: &Field, v: &str) {
            self.0.push((f.name().to_owned(), v.to_owned()));
        }
        fn record_bool(&mut self, f: &Field, v: bool) {
            self.0.push((f.name().to_owned(), v.to_string()));
        }
    }

    #[derive(Clone, Default)]
    pub struct Capture(pub Arc<Mutex<Vec<(u64, Span)>>>);

    impl<S: tracing::Subscriber> Layer<S> for Capture {
        fn on_new_span(&self, a: &Attributes<'_>, id: &Id, _: Context<'_, S>) {
            let mut s = Span {
                name: a.metadata().name().to_owned(),
                fields: vec![],
            };
            a.record(&mut V(&mut s.fields));
            self.0.lock().unwrap().push((id.into_u64(), s));
        }
        fn on_record(&self, id: &Id, r: &Record<'_>, _: Context<'_, S>) {
            let mut g = self.0.lock().unwrap();
            if let Some((_, s)) = g.iter_mut().rev().find(|(i, _)| *i == id.into_u64()) {
                r.record(&mut V(&mut s.fields));
            }
        }
    }
}

/// M-03 Hooks and spans.
pub async fn m_03(f: &dyn Factory) {
    use tracing_subscriber::layer::SubscriberExt;
    let c = Ctx::new(f).await;
    // The first two rows carry a trace id, the third none (its span field is then empty).
    let traces = [Some("trace-k1"), Some("trace-k2"), None];
    let mut e = Vec::new();
    for (k, t) in ["k1", "k2", "k3"].into_iter().zip(traces) {
        let b = c.ev(k);
        e.push(c.put(if let Some(t) = t { b.trace_id(t) } else { b }).await);
    }
    c.broker.script(e[1], [Action::Reject("no".into())]);
    let rec = Arc::new(Recorder::default());
    *rec.repo.lock().unwrap() = Some(c.repo());
    *rec.panic_first_completion.lock().unwrap() = true;
    let capture = spans::Capture::default();
    let subscriber = tracing_subscriber::registry().with(capture.clone());
    let guard = tracing::subscriber::set_default(subscriber);
    let relay = c.relay(&Cfg::default().step(rec.clone()));
    let c1 = c.run(&relay).await;
    let c2 = c.run(&relay).await;
    drop(guard);
    assert_eq!(*rec.fetches.lock().unwrap(), vec![3, 0]);
    let outs = rec.outcomes.lock().unwrap().clone();
    let completions: Vec<_> = outs
        .iter()
        .filter(|o| matches!(o.1, RowOutcome::Completed { .. }))
        .collect();
    assert_eq!(completions.len(), 2);
    assert!(
        completions.iter().all(|o| o.2.is_some()),
        "a completion without a duration"
    );
    assert_eq!(
        outs.iter()
            .filter(|o| matches!(o.1, RowOutcome::Counted { .. }))
            .count(),
        1
    );
    for (id, o, _, stored) in &outs {
        let s = stored.as_ref().unwrap();
        match o {
            RowOutcome::Completed { .. } => assert_eq!(s.status, Status::Completed, "{id}"),
            RowOutcome::Counted { .. } => assert_eq!(s.attempts_made, 1, "{id}"),
            other => panic!("unexpected outcome {other:?}"),
        }
    }
    // The panic changed neither the report nor the rows.
    assert_eq!(c1.report.completed.len(), 2);
    assert_eq!(c1.report.counted.len(), 1);
    assert!(c2.report.fetched.is_empty());
    c.assert_state(e[0], Status::Completed, 0).await;
    c.assert_state(e[2], Status::Completed, 0).await;
    let spans: Vec<spans::Span> = capture
        .0
        .lock()
        .unwrap()
        .iter()
        .map(|(_, s)| s.clone())
        .filter(|s| s.name == "process")
        .collect();
    assert_eq!(spans.len(), 3, "{spans:?}");
    for ((s, id), trace) in spans.iter().zip(&e).zip(traces) {
        assert_eq!(s.get("otel.name"), Some("process test.event"));
        assert_eq!(s.get("event.id"), Some(id.to_string().as_str()));
        assert_eq!(s.get("event.type"), Some("test.event"));
        assert_eq!(s.get("worker.id"), Some("w1"));
        assert_eq!(
            s.get("event.trace_id"),
            Some(trace.unwrap_or("")),
            "event.trace_id of {id}"
        );
    }
    assert_eq!(spans[1].get("error"), Some("true"));
    assert_eq!(spans[0].get("error"), None);
}

/// M-04 Blocked keys list a head held by a relay's live fetch, with its holder and lock time,
/// and stop listing it once the holder completed it (second scenario for R80's held heads,
/// besides M-01's fixture).
pub async fn m_04(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let a = c.puts(&["k", "k"]).await;
    c.puts(&["k2"]).await;
    assert_eq!(c.fetch("w1", 1, 1).await, vec![a[0]]);
    let bk = c
        .repo()
        .blocked_keys(Duration::from_secs(300), 100)
        .await
        .unwrap();
    assert_eq!(bk.len(), 1, "only k, whose head w1 holds: {bk:?}");
    assert_eq!((bk[0].partition_key.as_str(), bk[0].head_id), ("k", a[0]));
    assert_eq!(bk[0].locked_by.as_deref(), Some("w1"));
    assert_eq!(bk[0].locked_at, c.get(a[0]).await.locked_at);
    assert!(bk[0].locked_at.is_some());
    assert_eq!(bk[0].waiting, 1);
    let w1 = txoutbox_core::WorkerId::new("w1").unwrap();
    c.repo()
        .write_outcomes(
            &w1,
            &[txoutbox_core::repository::Outcome {
                id: a[0],
                kind: txoutbox_core::repository::OutcomeKind::Completed,
            }],
        )
        .await
        .unwrap();
    let bk = c
        .repo()
        .blocked_keys(Duration::from_secs(300), 100)
        .await
        .unwrap();
    assert!(
        bk.is_empty(),
        "nothing blocked once w1 completed its head: {bk:?}"
    );
}

/// One call of a step's `before_publish`: the step's name and the row.
type StepCall = (&'static str, Uuid);

/// A step that logs every `before_publish` call in a log shared with other steps, and answers
/// with the decision set for the row, or lets it go on.
struct LoggedStep {
    name: &'static str,
    log: Arc<Mutex<Vec<StepCall>>>,
    decisions: Vec<(Uuid, StepDecision)>,
}

#[async_trait]
impl PipelineStep for LoggedStep {
    async fn before_publish(&self, e: &OutboxEvent) -> Result<StepDecision, StepError> {
        self.log.lock().unwrap().push((self.name, e.id));
        Ok(self
            .decisions
            .iter()
            .find(|(id, _)| *id == e.id)
            .map_or(StepDecision::Continue, |(_, d)| d.clone()))
    }
}

/// P-10 Two chained steps: they run in the order added, and a row reaches the second step (and
/// the publish) only when the first lets it go on (R37).
pub async fn p_10(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e = c.puts(&["k1", "k2", "k3"]).await;
    let (counted, not_counted, goes_on) = (e[0], e[1], e[2]);
    let log = Arc::new(Mutex::new(Vec::new()));
    let first = LoggedStep {
        name: "first",
        log: log.clone(),
        decisions: vec![
            (
                counted,
                StepDecision::Fail {
                    error: "first step: no".into(),
                    counted: true,
                    retry_at: None,
                },
            ),
            (
                not_counted,
                StepDecision::Fail {
                    error: "first step: later".into(),
                    counted: false,
                    retry_at: None,
                },
            ),
        ],
    };
    let second = LoggedStep {
        name: "second",
        log: log.clone(),
        decisions: Vec::new(),
    };
    let cy = c
        .cycle(&Cfg::default().step(Arc::new(first)).step(Arc::new(second)))
        .await;
    assert_eq!(
        *log.lock().unwrap(),
        vec![
            ("first", counted),
            ("first", not_counted),
            ("first", goes_on),
            ("second", goes_on),
        ],
        "P-10: the second step must run after the first, and only for the row the first let go \
         on (R37)"
    );
    assert_eq!(
        cy.sent,
        vec![goes_on],
        "P-10: only the row both steps let go on is published (R37)"
    );
    c.assert_state(goes_on, Status::Completed, 0).await;
    let r = c.get(counted).await;
    assert_eq!(
        (r.status, r.attempts_made, r.last_error.as_deref()),
        (Status::Pending, 1, Some("first step: no")),
        "P-10: the first step's counted failure is written as it gave it (R37, R38)"
    );
    assert_eq!(
        cy.report.counted.iter().map(|x| x.id).collect::<Vec<_>>(),
        vec![counted]
    );
    assert_eq!(
        cy.report.transient.iter().map(|x| x.id).collect::<Vec<_>>(),
        vec![not_counted]
    );
}
