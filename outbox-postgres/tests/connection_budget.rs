//! The test harnesses' connection budget (issue 14): trials wait for their share instead of
//! opening pools past what the database can give, a nested share cannot deadlock, and a
//! connect is retried while the database is busy. No database needed.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use txoutbox_testkit::{
    CONNECT_PATIENCE, DEFAULT_TEST_CONNECTIONS, connect_patiently, reserve_connections,
};

#[tokio::test(start_paused = true)]
async fn a_trial_waits_for_its_share_and_is_never_stuck() {
    assert!(std::env::var("OUTBOX_TEST_PG_CONNECTIONS").is_err());
    let all = reserve_connections(DEFAULT_TEST_CONNECTIONS).await;
    assert!(all.is_within_budget());
    // The budget is spent: another share waits, then is granted over the budget rather than
    // waiting forever (a trial holding one share and asking for another must not deadlock).
    let t0 = tokio::time::Instant::now();
    let late = reserve_connections(1).await;
    assert!(!late.is_within_budget());
    assert_eq!(t0.elapsed(), CONNECT_PATIENCE);
    // A share given back is reserved again at once.
    let waiting = tokio::spawn(async { reserve_connections(3).await });
    tokio::task::yield_now().await;
    assert!(!waiting.is_finished(), "granted while the budget was spent");
    drop(all);
    let got = waiting.await.unwrap();
    assert!(got.is_within_budget());
    assert_eq!(t0.elapsed(), CONNECT_PATIENCE, "it waited for a timer");
}

#[tokio::test(start_paused = true)]
async fn a_busy_database_is_retried_until_it_accepts() {
    let tries = AtomicUsize::new(0);
    let t0 = tokio::time::Instant::now();
    let r: Result<u32, String> = connect_patiently(|| async {
        if tries.fetch_add(1, Ordering::SeqCst) < 5 {
            Err("sorry, too many clients already".to_owned())
        } else {
            Ok(7)
        }
    })
    .await;
    assert_eq!(r, Ok(7));
    assert_eq!(tries.load(Ordering::SeqCst), 6);
    // 20 + 40 + 80 + 160 + 320 ms between the tries.
    assert_eq!(t0.elapsed(), Duration::from_millis(620));
}
