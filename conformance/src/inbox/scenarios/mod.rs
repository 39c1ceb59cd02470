//! The inbox scenarios, one async function per ID, grouped by letter.

pub mod batches;
pub mod decoding;
pub mod dedup;
pub mod failures;
pub mod groups;
pub mod paced;
pub mod park;
pub mod pg;
pub mod policies;
pub mod processor;
pub mod processor_batches;
pub mod stand;
pub mod visibility;
