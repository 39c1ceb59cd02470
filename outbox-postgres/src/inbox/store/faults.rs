//! The store's test hooks (scenarios.md section 19's `fail_next_row_commit`, `db_down`,
//! `before_fresh_write`). With the cargo feature `test-hooks` (for tests only) they are
//! [`InboxFaults`], reached through [`super::PgInbox::faults`]; without it the store carries an
//! empty stand-in whose checks are constant, so no hook exists in a production build.

#[cfg(feature = "test-hooks")]
pub use hooks::{BeforeBegin, InboxFaults};
#[cfg(not(feature = "test-hooks"))]
pub(crate) use inert::InboxFaults;

#[cfg(feature = "test-hooks")]
mod hooks {
    use std::future::Future;
    use std::pin::Pin;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// A future run before the next transaction begins (the suite's `before_next_begin`).
    pub type BeforeBegin = Pin<Box<dyn Future<Output = ()> + Send>>;

    /// Test hooks of the store (cargo feature `test-hooks`, for tests only; scenarios.md
    /// section 19's `fail_next_row_commit`, `db_down`, `before_fresh_write`); inert unless a
    /// test sets them.
    #[derive(Default)]
    pub struct InboxFaults {
        fail_next_commit: AtomicBool,
        down: AtomicBool,
        before_next_begin: Mutex<Option<BeforeBegin>>,
    }

    impl std::fmt::Debug for InboxFaults {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("InboxFaults")
                .field("fail_next_commit", &self.fail_next_commit)
                .field("down", &self.down)
                .finish()
        }
    }

    impl InboxFaults {
        /// The next T or T_row fails when it commits (it is rolled back instead).
        pub fn fail_next_commit(&self) {
            self.fail_next_commit.store(true, Ordering::SeqCst);
        }
        /// Every new transaction fails to begin (`true`), or no longer does.
        pub fn set_down(&self, down: bool) {
            self.down.store(down, Ordering::SeqCst);
        }
        /// Runs `f` just before the next transaction begins.
        pub fn before_next_begin(&self, f: BeforeBegin) {
            *self.before_next_begin.lock().expect("poisoned") = Some(f);
        }

        /// Runs the `before_next_begin` future, if one is set (once).
        pub(crate) async fn before_begin(&self) {
            let hook = self.before_next_begin.lock().expect("poisoned").take();
            if let Some(f) = hook {
                f.await;
            }
        }
        /// Whether new transactions fail to begin.
        pub(crate) fn down(&self) -> bool {
            self.down.load(Ordering::SeqCst)
        }
        /// Whether this commit is to fail (the flag is cleared).
        pub(crate) fn take_fail_commit(&self) -> bool {
            self.fail_next_commit.swap(false, Ordering::SeqCst)
        }
    }
}

#[cfg(not(feature = "test-hooks"))]
mod inert {
    /// Without `test-hooks`: no hook, every check constant.
    #[derive(Debug, Default)]
    pub(crate) struct InboxFaults;

    impl InboxFaults {
        pub(crate) async fn before_begin(&self) {}
        pub(crate) fn down(&self) -> bool {
            false
        }
        pub(crate) fn take_fail_commit(&self) -> bool {
            false
        }
    }
}
