//! The inbox scenarios, one async function per ID, grouped by letter.

pub mod failures;
pub mod policies;
pub mod processor;
