//! The scenarios of scenarios.md, one async function per ID, grouped as the document groups them.
//!
//! Each function takes a [`Factory`](crate::Factory), makes the fresh stores it needs, and
//! panics (through `assert!`) when the backend breaks the contract.

pub mod order;
pub mod validation;
pub mod writing;
