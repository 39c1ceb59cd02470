//! The stop signal of a service built on the library's loops (R197): a
//! [`CancellationToken`] cancelled at the first SIGINT or SIGTERM (Ctrl-C off Unix), with the
//! signal handlers installed before [`stop_on_signals`] returns.
//!
//! Call it first, before any start-up step that can wait (connecting to the database or the
//! broker, waiting for a stream that does not exist yet), and let those steps and the loop
//! ([`Relay::run`](crate::Relay::run), [`Runner::run`](crate::inbox::Runner::run),
//! [`Processor::run`](crate::inbox::Processor::run)) take the token: a signal received at any
//! point then stops the process cleanly, with exit code 0, instead of killing it (exit 143 for
//! SIGTERM) because no handler was installed yet.
//!
//! ```no_run
//! # async fn connect() {}
//! # #[tokio::main] async fn main() -> std::io::Result<()> {
//! let stop = txoutbox_core::signal::stop_on_signals()?;
//! tokio::select! {
//!     _ = connect() => { /* build the runner, then runner.run(stop.clone()).await */ }
//!     _ = stop.cancelled() => return Ok(()), // stopped during start-up
//! }
//! # Ok(()) }
//! ```

use tokio_util::sync::CancellationToken;

/// A token cancelled at the first SIGINT or SIGTERM (Ctrl-C off Unix). The handlers are
/// installed when this returns, so a signal that arrives from then on is never lost; a second
/// signal does not kill the process either (it waits for the loops to stop). Must be called
/// inside a tokio runtime; fails only when the operating system refuses the handler.
pub fn stop_on_signals() -> std::io::Result<CancellationToken> {
    let token = CancellationToken::new();
    let cancel = token.clone();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        tokio::spawn(async move {
            let name = tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            };
            tracing::info!(signal = name, "signal received: stopping");
            cancel.cancel();
        });
    }
    #[cfg(not(unix))]
    {
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                tracing::info!(signal = "ctrl-c", "signal received: stopping");
                cancel.cancel();
            }
        });
    }
    Ok(token)
}
