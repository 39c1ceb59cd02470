//! The conformance scenarios, one async function per ID (`o_02` is O-02), grouped by letter.
//!
//! Each function takes a [`Factory`](crate::Factory), makes the fresh stores it needs, and
//! panics (through `assert!`) when the backend breaks the contract.

pub mod backoff;
pub mod lease;
pub mod maint;
pub mod order;
pub mod outage;
pub mod park;
pub mod pg;
pub mod pipeline;
pub mod runs;
pub mod stand;
pub mod tx;
pub mod validation;
pub mod writing;
