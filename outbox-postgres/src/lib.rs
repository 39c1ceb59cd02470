#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

pub mod error;
pub mod sql;

pub use error::Error;
pub use sql::TableName;
