#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

pub mod harness;
pub mod memory;

pub use harness::{BackendKind, Factory, Harness, RowPatch, WriteTx};
