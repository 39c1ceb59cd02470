//! Not yet implemented: see the README of this crate.
#![deny(missing_docs)]
