//! OP-06: parked inbox keys (operations.md R191, R192): a runner with `on_exhausted = park`,
//! its embedded processor inheriting it, and the redrive by group and key.

use std::time::Duration;

use txoutbox_core::event::Status;
use txoutbox_core::inbox::DeliveryOutcome as O;
use txoutbox_core::inbox::repository::InboxRepository;
use txoutbox_core::repository::{OnExhausted, ParkedTarget};

use crate::inbox::ctx::{Ictx, g};
use crate::inbox::harness::InboxFactory;
use crate::inbox::script::Act;

/// OP-06 Inbox park: a runner with on_exhausted park (its embedded processor inherits it) and a
/// message whose handler fails every time it runs: parked after its last attempt, holding its
/// key; redriven by the group and key it completes first, then its successors; each effect
/// once.
pub async fn op_06<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    c.deliver("m1", Some("k"));
    c.deliver("m2", Some("k"));
    c.deliver("m3", Some("k"));
    c.script(
        "m1",
        vec![Act::Fail("poison".into()), Act::Fail("poison".into())],
    );
    let runner = c
        .runner()
        .max_attempts(2)
        .on_exhausted(OnExhausted::Park)
        .process_stored(true)
        .build()
        .expect("runner");
    assert_eq!(
        c.handle(&runner).await.outcome,
        O::Recorded,
        "m1's first attempt"
    );
    for _ in 0..2 {
        // m2 and m3 land behind m1, which is in line (R116).
        assert_eq!(c.handle(&runner).await.outcome, O::Landed);
    }
    let p = runner.embedded_processor().expect("embedded processor");
    for _ in 0..6 {
        c.advance(Duration::from_secs(3600)).await;
        c.cycle(p).await;
    }
    let m1 = c.row_of("m1").await;
    assert_eq!(
        (m1.status, m1.attempts_made, m1.last_error.as_deref()),
        (Status::Pending, 2, Some("poison")),
        "parked by the embedded processor, which inherits the runner's setting"
    );
    for m in ["m2", "m3"] {
        let r = c.row_of(m).await;
        assert_eq!(
            (r.status, r.attempts_made),
            (Status::Pending, 0),
            "{m} waits"
        );
    }
    assert!(c.effects().await.is_empty());
    assert_eq!(
        *c.rec.parked.lock().expect("poisoned"),
        vec![("m1".to_owned(), 1, "poison".to_owned())],
        "the park calls the parked hook once (R193)"
    );
    assert!(
        c.rec.terminal_ids().is_empty(),
        "a park is not a terminal failure"
    );
    let store = c.backend();
    let blocked = store
        .blocked_keys(&g(), Duration::from_secs(300), 10)
        .await
        .expect("blocked");
    assert_eq!(blocked.len(), 1, "{blocked:?}");
    assert!(
        blocked[0].parked && blocked[0].head_id == m1.id,
        "{blocked:?}"
    );
    assert_eq!(
        store.parked_counts(&g()).await.expect("parked counts"),
        (1, 1),
        "inbox_parked_keys and inbox_parked_rows count m1 (R193)"
    );
    let redriven = store
        .redrive(
            &g(),
            &ParkedTarget::Key {
                topic: "src".into(),
                partition_key: "k".into(),
            },
        )
        .await
        .expect("redrive");
    assert_eq!(redriven, vec![m1.id]);
    for _ in 0..3 {
        c.cycle(p).await;
    }
    assert_eq!(
        c.effects().await,
        vec!["m1", "m2", "m3"],
        "in order, once each"
    );
    for m in ["m1", "m2", "m3"] {
        assert_eq!(c.row_of(m).await.status, Status::Completed);
    }
}
