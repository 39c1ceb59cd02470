//! Issue 14: a failed outcome commit (its connection terminated, as a database restart does) is
//! retried on a fresh connection, so the rows move at once instead of waiting out the lease.

use txoutbox_testkit::{PgHarness, database_url, outcome_commit_survives_termination};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_outcome_commit_is_retried_on_a_fresh_connection() {
    let h = PgHarness::create(&database_url(), "outbox_events").await;
    let took = outcome_commit_survives_termination(h.sqlx_repository(), &h).await;
    println!(
        "sqlx: rows completed {took:?} after the outcome transaction's backend was terminated"
    );
    assert!(took < std::time::Duration::from_secs(1), "{took:?}");
}
