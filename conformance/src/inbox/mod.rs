//! The inbox half of the suite (contract Part II, scenarios.md sections 19 to 29).
//!
//! A backend implements [`InboxHarness`] and [`InboxFactory`] and runs
//! [`crate::inbox_suite!`]; each scenario is one async function named after its ID (`n_14` is
//! N-14) in a file named after its group: [`scenarios::policies`] (N), [`scenarios::failures`]
//! (F), [`scenarios::groups`] (G), [`scenarios::processor`] (Y and the ancestor's P, B, T, H
//! inbox IDs), [`scenarios::dedup`] (D, I-06), [`scenarios::decoding`] (E),
//! [`scenarios::visibility`] (A) and [`scenarios::stand`] (SI).

pub mod broker_subs;
pub mod channel;
pub mod ctx;
pub mod end_to_end;
pub mod harness;
pub mod memory;
pub mod peer;
pub mod scenarios;
pub mod script;

pub use harness::{InboxFactory, InboxHarness, InboxPatch};
