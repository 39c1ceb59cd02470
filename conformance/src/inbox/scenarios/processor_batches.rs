//! BT (the processor's half, batches.md): processor transactions of several rows (R183, R189).

use std::time::Duration;

use txoutbox_core::event::Status;
use txoutbox_core::inbox::RowReport;

use crate::inbox::ctx::Ictx;
use crate::inbox::harness::{InboxFactory, InboxHarness as _, InboxPatch};
use crate::inbox::script::Act;

/// BT-11: 100 stored pending rows over 10 keys, rows_per_transaction 16, one run fails (k3's
/// 4th row writes its effect, then fails) and one row's guard fails (k0's 2nd row, leased to
/// another worker after the fetch). Expected: each key's rows in one T_b (counted), the failed
/// row recorded without its effect and the rows behind it released untouched, the row whose
/// guard failed not run (lease lost) and the rows behind it released, every other key
/// completed in order, effects once; the next cycles finish every key, in order, effects once.
pub async fn bt_11<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let keys: Vec<String> = (0..10).map(|k| format!("k{k}")).collect();
    let mut ids = Vec::new();
    for i in 0..10 {
        for k in &keys {
            let m = format!("{k}-m{i}");
            ids.push((k.clone(), m.clone(), c.land(&m, Some(k)).await.id));
        }
    }
    let of_key = |k: &str| -> Vec<uuid::Uuid> {
        ids.iter()
            .filter(|(kk, _, _)| kk == k)
            .map(|(_, _, id)| *id)
            .collect()
    };
    c.script("k3-m3", vec![Act::Fail("bad".into()), Act::Write]);
    // After the fetch, before the first T_b (k0's) begins: k0's 2nd row is leased to another
    // worker, so that T_b's guard fails for it alone.
    let stolen = of_key("k0")[1];
    let h = c.h.clone();
    let now = c.now().await;
    c.h.before_next_begin(Box::pin(async move {
        h.set(stolen, InboxPatch::held("p-other", now)).await;
    }));
    let p = c
        .processor()
        .max_per_key(10)
        .handler_concurrency(4)
        .rows_per_transaction(16)
        .build()
        .unwrap();
    let rep = c.cycle(&p).await;
    assert_eq!(rep.fetched.len(), 100, "BT-11: one fetch of every row");
    // Each key's rows in one T_b: ten transactions of ten rows.
    let mut txs = rep.transactions.clone();
    txs.sort_by_key(|t| ids.iter().position(|(_, _, id)| *id == t[0]));
    let expected: Vec<Vec<uuid::Uuid>> = keys.iter().map(|k| of_key(k)).collect();
    assert_eq!(
        txs, expected,
        "BT-11: one T_b per key, each with the key's rows in order"
    );
    // k0: the first row completed, the stolen one lease lost (not run), the rest released.
    let k0 = of_key("k0");
    assert!(
        matches!(rep.of(k0[0]), Some(RowReport::Completed { .. })),
        "{:?}",
        rep.of(k0[0])
    );
    assert_eq!(
        rep.of(stolen),
        Some(&RowReport::LeaseLost),
        "BT-11: a row whose guard failed is not run"
    );
    for id in &k0[2..] {
        assert_eq!(rep.of(*id), Some(&RowReport::Released));
    }
    let r = c.row_of("k0-m1").await;
    assert_eq!(
        (r.status, r.attempts_made, r.locked_by.as_deref()),
        (Status::Pending, 0, Some("p-other"))
    );
    // k3: three completed, the 4th recorded (counted, no effect), the six behind it untouched.
    let k3 = of_key("k3");
    for id in &k3[..3] {
        assert!(matches!(rep.of(*id), Some(RowReport::Completed { .. })));
    }
    assert!(
        matches!(
            rep.of(k3[3]),
            Some(RowReport::Counted {
                terminal: false,
                ..
            })
        ),
        "{:?}",
        rep.of(k3[3])
    );
    let failed = c.row_of("k3-m3").await;
    assert_eq!(
        (
            failed.status,
            failed.attempts_made,
            failed.last_error.as_deref()
        ),
        (Status::Pending, 1, Some("bad"))
    );
    for (i, id) in k3[4..].iter().enumerate() {
        assert_eq!(rep.of(*id), Some(&RowReport::Released));
        let r = c.row_of(&format!("k3-m{}", i + 4)).await;
        assert_eq!(
            (
                r.status,
                r.attempts_made,
                r.locked_at,
                r.last_error.as_deref()
            ),
            (Status::Pending, 0, None, None),
            "BT-11: a row behind a failed row is released untouched"
        );
    }
    // Every other key completed, in order, effects once.
    let effects = c.effects().await;
    for k in keys.iter().filter(|k| *k != "k0" && *k != "k3") {
        for id in of_key(k) {
            assert!(matches!(rep.of(id), Some(RowReport::Completed { .. })));
        }
        let mine: Vec<&String> = effects
            .iter()
            .filter(|e| e.starts_with(&format!("{k}-")))
            .collect();
        let want: Vec<String> = (0..10).map(|i| format!("{k}-m{i}")).collect();
        assert_eq!(
            mine,
            want.iter().collect::<Vec<_>>(),
            "BT-11: {k}'s effects once, in order"
        );
    }
    assert!(
        !effects.contains(&"k3-m3".to_owned()),
        "BT-11: a failed run leaves no effect"
    );
    assert!(
        !effects.contains(&"k0-m1".to_owned()),
        "BT-11: a row whose guard failed is not run"
    );
    assert_eq!(effects.len(), 8 * 10 + 1 + 3);
    // The rest: k0 after the other worker's lease, k3 after its retry; in order, once each.
    c.set(
        stolen,
        InboxPatch {
            lock: Some(None),
            ..Default::default()
        },
    )
    .await;
    c.advance(Duration::from_secs(3600)).await;
    for _ in 0..4 {
        c.cycle(&p).await;
    }
    let effects = c.effects().await;
    for k in &keys {
        let mine: Vec<&String> = effects
            .iter()
            .filter(|e| e.starts_with(&format!("{k}-")))
            .collect();
        let want: Vec<String> = (0..10).map(|i| format!("{k}-m{i}")).collect();
        assert_eq!(
            mine,
            want.iter().collect::<Vec<_>>(),
            "BT-11: {k} finished in order, effects once"
        );
    }
    assert_eq!(effects.len(), 100);
}

/// BT-11 (a failed commit, R189): a T_b whose commit fails applies nothing, and each of its rows
/// is handled again at once, in the same cycle, in a T_row of its own under R152's guard (not
/// left to its lease): every row completed once, per key in order, no T_b counted.
pub async fn bt_11_commit<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let mut rows = Vec::new();
    for i in 0..3 {
        for k in ["a", "b"] {
            rows.push(c.land(&format!("{k}{i}"), Some(k)).await.id);
        }
    }
    c.h.fail_next_row_commit();
    let p = c
        .processor()
        .max_per_key(10)
        .rows_per_transaction(16)
        .build()
        .unwrap();
    let rep = c.cycle(&p).await;
    assert!(
        rep.transactions.is_empty(),
        "BT-11: the failed T_b is not counted: {rep:?}"
    );
    let mut done = rep.completed();
    done.sort();
    rows.sort();
    assert_eq!(
        done, rows,
        "BT-11: every row handled again at once: {rep:?}"
    );
    let effects = c.effects().await;
    for k in ["a", "b"] {
        let mine: Vec<&String> = effects.iter().filter(|e| e.starts_with(k)).collect();
        assert_eq!(
            mine,
            vec![&format!("{k}0"), &format!("{k}1"), &format!("{k}2")]
        );
    }
    assert_eq!(effects.len(), 6);
}
