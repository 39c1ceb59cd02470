//! B: backoff and attempts, and H: outcome mapping of a step.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use txoutbox_core::backoff::{Backoff, Fixed, SeededRng};
use txoutbox_core::error::StepError;
use txoutbox_core::event::{NewEvent, OutboxEvent, Status, WorkerId};
use txoutbox_core::repository::{Outcome, OutcomeKind, Retry};
use txoutbox_core::scripted::Action;
use txoutbox_core::step::{PipelineStep, StepDecision};
use uuid::Uuid;

use crate::ctx::{Cfg, Ctx, Cycle};
use crate::harness::{Factory, RowPatch};

fn rej(t: &str) -> Action {
    Action::Reject(t.into())
}

/// A step that answers every row the same way before the publish.
struct FixedStep(Result<StepDecision, StepError>);

#[async_trait]
impl PipelineStep for FixedStep {
    async fn before_publish(&self, _event: &OutboxEvent) -> Result<StepDecision, StepError> {
        self.0.clone()
    }
}

fn step(r: Result<StepDecision, StepError>) -> Arc<dyn PipelineStep> {
    Arc::new(FixedStep(r))
}

fn fail(error: &str, counted: bool, retry_at: Option<DateTime<Utc>>) -> Arc<dyn PipelineStep> {
    step(Ok(StepDecision::Fail {
        error: error.into(),
        counted,
        retry_at,
    }))
}

/// B-01 First counted failure.
pub async fn b_01(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let a = c.put(c.ev("k")).await;
    c.broker.script(a, [rej("bad")]);
    let c1 = c.cycle1().await;
    let r = c.get(a).await;
    assert_eq!((r.status, r.attempts_made), (Status::Pending, 1));
    c.assert_next_try_within(&c1, r.scheduled_at, 5.0, 10.0);
    assert_eq!(c1.report.counted.len(), 1);
    assert_eq!(c1.report.counted[0].id, a);
    assert_eq!(c1.report.counted[0].next_try, Some(r.scheduled_at));
}

/// B-02 Growth and cap.
pub async fn b_02(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let a = c.put(c.ev("k").max_attempts(10)).await;
    c.broker.set_default(rej("no"));
    let cfg = Cfg {
        cap: 8.0,
        ..Cfg::default().base(1.0)
    };
    let windows = [
        (0.5, 1.0),
        (1.0, 2.0),
        (2.0, 4.0),
        (4.0, 8.0),
        (4.0, 8.0),
        (4.0, 8.0),
    ];
    for (i, (lo, hi)) in windows.into_iter().enumerate() {
        c.advance_to(a).await;
        let cy = c.cycle(&cfg).await;
        assert_eq!(cy.report.counted.len(), 1, "failure {}", i + 1);
        let r = c.get(a).await;
        assert_eq!((r.status, r.attempts_made), (Status::Pending, i as i32 + 1));
        c.assert_next_try_within(&cy, r.scheduled_at, lo, hi);
    }
}

/// B-03 The default window table.
pub async fn b_03(_f: &dyn Factory) {
    let b = Backoff::default();
    let table = [
        (5.0, 10.0),
        (10.0, 20.0),
        (20.0, 40.0),
        (40.0, 80.0),
        (80.0, 160.0),
        (160.0, 320.0),
    ];
    let table: Vec<(f64, f64)> = table
        .into_iter()
        .chain([(320.0, 640.0), (640.0, 1280.0), (1280.0, 2560.0)])
        .chain(std::iter::repeat_n((1800.0, 3600.0), 4))
        .collect();
    assert_eq!(table.len(), 13);
    let mut rng = SeededRng::new(2024);
    for (a, (lo, hi)) in table.into_iter().enumerate() {
        let a = a as u32;
        assert_eq!(
            b.delay(a, &mut Fixed(0.0)),
            Some(Duration::from_secs_f64(lo)),
            "low bound at a = {a}"
        );
        assert_eq!(
            b.delay(a, &mut Fixed(1.0)),
            Some(Duration::from_secs_f64(hi)),
            "high bound at a = {a}"
        );
        let (mut min, mut max) = (f64::INFINITY, f64::NEG_INFINITY);
        for _ in 0..2000 {
            let d = b.delay(a, &mut rng).expect("backoff on").as_secs_f64();
            assert!(
                (lo..=hi).contains(&d),
                "draw {d} outside [{lo}, {hi}] at a = {a}"
            );
            (min, max) = (min.min(d), max.max(d));
        }
        // The seeded draws spread over the window (jitter, R39): 2000 uniform draws come within
        // 1 % of both ends (a miss has probability below 1e-8 for seed 2024's fixed sequence).
        let edge = (hi - lo) * 0.01;
        assert!(
            min <= lo + edge && max >= hi - edge,
            "draws at a = {a} span only [{min}, {max}] of [{lo}, {hi}]"
        );
    }
}

/// B-04 Base 0 retries next cycle.
pub async fn b_04(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let a = c.put(c.ev("k")).await;
    c.broker.script(a, [rej("x"), rej("x")]);
    // Time passes before the failure, so "kept" and "moved to now" differ.
    c.advance(Duration::from_secs(5)).await;
    let before = c.get(a).await;
    let cfg = Cfg::default().base(0.0);
    let c1 = c.cycle(&cfg).await;
    let r = c.get(a).await;
    assert_eq!(r.attempts_made, 1);
    assert_eq!(
        r.scheduled_at, before.scheduled_at,
        "B-04: a counted failure with base 0 keeps scheduled_at (R38, R40)"
    );
    assert!(r.scheduled_at < c1.t0, "base 0 moved the schedule");
    let c2 = c.cycle(&cfg).await;
    assert_eq!(c2.report.fetched, vec![a]);
    assert_eq!(c.get(a).await.attempts_made, 2);
    assert_eq!(c.broker.called_ids(), vec![a, a]);
}

/// B-05 Backoff settings are validated.
pub async fn b_05(_f: &dyn Factory) {
    let e = Backoff::new(-1.0, 3600.0)
        .expect_err("base -1 accepted")
        .to_string();
    assert!(e.contains("retry_backoff_base_seconds must be >= 0"), "{e}");
    let e = Backoff::new(10.0, 0.0)
        .expect_err("cap 0 accepted")
        .to_string();
    assert!(e.contains("retry_backoff_cap_seconds must be > 0"), "{e}");
}

/// B-06 An explicit retry time wins.
pub async fn b_06(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let a = c.put(c.ev("k")).await;
    let t = c.now().await + chrono::Duration::seconds(42);
    c.cycle(&Cfg::default().step(fail("later", true, Some(t))))
        .await;
    let r = c.get(a).await;
    assert_eq!(r.attempts_made, 1);
    assert_eq!(r.scheduled_at, t);
    assert!(c.broker.calls().is_empty());
}

/// B-07 A counted step failure without a time gets the backoff.
pub async fn b_07(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let a = c.put(c.ev("k")).await;
    let c1 = c.cycle(&Cfg::default().step(fail("x", true, None))).await;
    let r = c.get(a).await;
    assert_eq!(r.attempts_made, 1);
    assert_eq!(r.last_error.as_deref(), Some("x"));
    c.assert_next_try_within(&c1, r.scheduled_at, 5.0, 10.0);
}

/// B-08 A non-counted step failure without a time keeps the schedule.
pub async fn b_08(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let a = c.put(c.ev("k")).await;
    let before = c.get(a).await;
    c.cycle(&Cfg::default().step(fail("x", false, None))).await;
    let r = c.get(a).await;
    assert_eq!(r.attempts_made, 0);
    assert_eq!(r.scheduled_at, before.scheduled_at);
    assert_eq!(r.last_error.as_deref(), Some("x"));
    assert!(r.locked_at.is_none() && r.locked_by.is_none());
    assert_eq!(c.cycle1().await.report.fetched, vec![a]);
}

/// B-10 The attempt budget.
pub async fn b_10(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let a = c.put(c.ev("k")).await;
    c.broker.set_default(rej("no"));
    let mut total = 0.0;
    for n in 1..=6 {
        let r = c.get(a).await;
        let now = c.now().await;
        if r.scheduled_at > now {
            total += (r.scheduled_at - now).to_std().unwrap().as_secs_f64();
        }
        c.advance_to(a).await;
        let cy = c.cycle1().await;
        assert_eq!(cy.report.counted.len(), 1, "failure {n}");
        let r = c.get(a).await;
        if n < 6 {
            assert_eq!((r.status, r.attempts_made), (Status::Pending, n));
        } else {
            assert_eq!((r.status, r.attempts_made), (Status::Failed, 6));
            c.assert_next_try_within(&cy, r.scheduled_at, 160.0, 320.0);
        }
    }
    // An injected clock stands still during a cycle, so the waits are the backoff exactly; a
    // database clock runs on during the cycle and the read of now.
    let slack = if c.clock_stands_still() { 0.0 } else { 1.0 };
    assert!(
        (155.0 - slack..=310.0 + slack).contains(&total),
        "total advance {total} s"
    );
    c.advance(Duration::from_secs(3600)).await;
    assert!(c.cycle1().await.report.fetched.is_empty());
}

async fn busy_relay(c: &Ctx, base: f64) -> (Uuid, Vec<Cycle>) {
    let p = c.put(c.ev("p")).await;
    let others: Vec<NewEvent> = (0..600)
        .map(|i| c.ev(&format!("key-{:03}", i % 100)).build().unwrap())
        .collect();
    c.write(others).await;
    c.broker.script(p, std::iter::repeat_n(rej("always"), 10));
    let cfg = Cfg::default().batch(50).base(base);
    let mut cycles = vec![];
    for _ in 0..6 {
        cycles.push(c.cycle(&cfg).await);
    }
    (p, cycles)
}

async fn completed_rows(c: &Ctx) -> i64 {
    let counts = c.repo().counts().await.unwrap();
    counts
        .iter()
        .filter(|s| s.status == Status::Completed)
        .map(|s| s.count)
        .sum()
}

/// B-12 Ancestor issue #61: a busy relay, default backoff.
pub async fn b_12(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let (p, cycles) = busy_relay(&c, 10.0).await;
    let r = c.get(p).await;
    assert_eq!((r.status, r.attempts_made), (Status::Pending, 1));
    c.assert_next_try_within(&cycles[0], r.scheduled_at, 5.0, 10.0);
    assert!(
        r.scheduled_at > c.now().await,
        "P's next try is already due"
    );
    let per_cycle: Vec<usize> = cycles.iter().map(|cy| cy.report.completed.len()).collect();
    assert_eq!(per_cycle, vec![49, 50, 50, 50, 50, 50]);
    assert_eq!(completed_rows(&c).await, 299);
    assert!(cycles.iter().all(|cy| !cy.report.completed.contains(&p)));
}

/// B-13 Ancestor issue #61 with base 0.
pub async fn b_13(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let (p, cycles) = busy_relay(&c, 0.0).await;
    c.assert_state(p, Status::Failed, 6).await;
    let per_cycle: Vec<usize> = cycles.iter().map(|cy| cy.report.completed.len()).collect();
    assert_eq!(per_cycle, vec![49; 6]);
    assert_eq!(completed_rows(&c).await, 294);
}

/// B-14 A failure written without a time keeps the schedule.
pub async fn b_14(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e = c.puts(&["ka", "kb"]).await;
    let (a, b) = (e[0], e[1]);
    let mut got = c.fetch("w1", 100, 1).await;
    got.sort();
    let mut want = vec![a, b];
    want.sort();
    assert_eq!(got, want);
    let (ba, bb) = (c.get(a).await, c.get(b).await);
    let w1 = WorkerId::new("w1").unwrap();
    c.repo()
        .write_outcomes(
            &w1,
            &[
                Outcome {
                    id: a,
                    kind: OutcomeKind::Counted {
                        error: "x".into(),
                        retry: Retry::Keep,
                        exhausted: txoutbox_core::repository::OnExhausted::Release,
                    },
                },
                Outcome {
                    id: b,
                    kind: OutcomeKind::Transient {
                        error: "y".into(),
                        retry: Retry::Keep,
                    },
                },
            ],
        )
        .await
        .unwrap();
    for (before, attempts, err) in [(ba, 1, "x"), (bb, 0, "y")] {
        let r = c.get(before.id).await;
        assert_eq!(r.attempts_made, attempts);
        assert_eq!(r.scheduled_at, before.scheduled_at);
        assert_eq!(r.last_error.as_deref(), Some(err));
        assert!(r.locked_at.is_none() && r.locked_by.is_none());
    }
}

/// One cycle over one row (with attempts_made set by fixture when > 0) under this config. The
/// clock moves 5 s between the write and the cycle, so a kept schedule differs from now.
async fn one_row(f: &dyn Factory, cfg: Cfg, attempts: i32) -> (Ctx, Uuid, OutboxEvent, Cycle) {
    let c = Ctx::new(f).await;
    let a = c.put(c.ev("k")).await;
    c.advance(Duration::from_secs(5)).await;
    if attempts > 0 {
        c.set(
            a,
            RowPatch {
                attempts_made: Some(attempts),
                ..RowPatch::default()
            },
        )
        .await;
    }
    let before = c.get(a).await;
    let cy = c.cycle(&cfg).await;
    (c, a, before, cy)
}

/// H-01 A step that lets the row go on.
pub async fn h_01(f: &dyn Factory) {
    let (c, a, _, cy) = one_row(f, Cfg::default().step(step(Ok(StepDecision::Continue))), 0).await;
    assert_eq!(cy.sent, vec![a]);
    c.assert_state(a, Status::Completed, 0).await;
}

/// H-05 A step that fails the row counted with text `bad`.
pub async fn h_05(f: &dyn Factory) {
    let (c, a, _, cy) = one_row(f, Cfg::default().step(fail("bad", true, None)), 0).await;
    assert_eq!(cy.report.counted.len(), 1);
    let r = c.get(a).await;
    assert_eq!(
        (r.status, r.attempts_made, r.last_error.as_deref()),
        (Status::Pending, 1, Some("bad"))
    );
    c.assert_next_try_within(&cy, r.scheduled_at, 5.0, 10.0);
    assert!(cy.sent.is_empty());
}

/// H-06 A counted step failure with empty text.
pub async fn h_06(f: &dyn Factory) {
    let (c, a, _, _) = one_row(f, Cfg::default().step(fail("", true, None)), 0).await;
    let r = c.get(a).await;
    assert_eq!(r.attempts_made, 1);
    assert_eq!(r.last_error.as_deref(), Some("Unknown error"));
}

/// H-08 A step that returns an error whose display is `kaboom`.
pub async fn h_08(f: &dyn Factory) {
    let (c, a, _, cy) = one_row(
        f,
        Cfg::default().step(step(Err(StepError::counted("kaboom")))),
        0,
    )
    .await;
    assert_eq!(cy.report.counted.len(), 1);
    let r = c.get(a).await;
    assert_eq!(
        (r.attempts_made, r.last_error.as_deref()),
        (1, Some("kaboom"))
    );
}

/// H-09 A step that returns a transient error.
pub async fn h_09(f: &dyn Factory) {
    let s = step(Err(StepError::transient("payment gateway unreachable")));
    let (c, a, _, cy) = one_row(f, Cfg::default().step(s), 0).await;
    assert!(cy.report.counted.is_empty());
    assert_eq!(cy.report.transient.len(), 1);
    let r = c.get(a).await;
    assert_eq!(
        (r.attempts_made, r.last_error.as_deref()),
        (0, Some("payment gateway unreachable"))
    );
    c.assert_next_try_after(&cy, r.scheduled_at, 1.0);
}

/// H-10 A counted failure at attempts_made 0, base 10 s.
pub async fn h_10(f: &dyn Factory) {
    let (c, a, _, cy) = one_row(f, Cfg::default().base(10.0).step(fail("x", true, None)), 0).await;
    let r = c.get(a).await;
    assert_eq!(r.attempts_made, 1);
    c.assert_next_try_within(&cy, r.scheduled_at, 5.0, 10.0);
}

/// H-11 A counted failure at attempts_made 3 (fixture).
pub async fn h_11(f: &dyn Factory) {
    let (c, a, _, cy) = one_row(f, Cfg::default().step(fail("x", true, None)), 3).await;
    let r = c.get(a).await;
    assert_eq!(r.attempts_made, 4);
    c.assert_next_try_within(&cy, r.scheduled_at, 40.0, 80.0);
}

/// H-12 A counted failure with base 0.
pub async fn h_12(f: &dyn Factory) {
    let (c, a, before, cy) =
        one_row(f, Cfg::default().base(0.0).step(fail("x", true, None)), 0).await;
    let r = c.get(a).await;
    assert_eq!(r.attempts_made, 1);
    assert_eq!(
        r.scheduled_at, before.scheduled_at,
        "H-12: a counted step failure with base 0 keeps scheduled_at (R38, R40)"
    );
    assert!(r.scheduled_at < cy.t0, "base 0 moved the schedule");
}

/// H-13 A counted failure with an explicit time T = now + 42 s.
pub async fn h_13(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let a = c.put(c.ev("k")).await;
    let t = c.now().await + chrono::Duration::seconds(42);
    c.cycle(&Cfg::default().step(fail("x", true, Some(t))))
        .await;
    let r = c.get(a).await;
    assert_eq!(r.attempts_made, 1);
    assert_eq!(r.scheduled_at, t);
}

/// H-14 A transient step error, with base 0 and again with base 100 s.
pub async fn h_14(f: &dyn Factory) {
    for base in [0.0, 100.0] {
        let s = step(Err(StepError::transient("gone")));
        let (c, a, _, cy) = one_row(f, Cfg::default().base(base).step(s), 0).await;
        let r = c.get(a).await;
        assert_eq!(r.attempts_made, 0, "base {base}");
        c.assert_next_try_after(&cy, r.scheduled_at, 1.0);
    }
}

/// H-15 An explicit retry time is used only within [created_at, created_at + 365 days], both
/// ends included; outside it the backoff applies (R44).
pub async fn h_15(f: &dyn Factory) {
    for (offset, used) in [
        (chrono::Duration::seconds(-1), false),
        (chrono::Duration::zero(), true),
        (chrono::Duration::days(365), true),
        (
            chrono::Duration::days(365) + chrono::Duration::seconds(1),
            false,
        ),
    ] {
        let c = Ctx::new(f).await;
        let a = c.put(c.ev("k")).await;
        let t = c.get(a).await.created_at + offset;
        let cy = c
            .cycle(&Cfg::default().step(fail("x", true, Some(t))))
            .await;
        let r = c.get(a).await;
        assert_eq!(r.attempts_made, 1);
        if used {
            assert_eq!(
                r.scheduled_at, t,
                "offset {offset}: the explicit time was not used"
            );
        } else {
            c.assert_next_try_within(&cy, r.scheduled_at, 5.0, 10.0);
        }
    }
}
