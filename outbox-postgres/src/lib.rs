//! Not yet implemented.
#![deny(missing_docs)]
