//! The worker id (R10, R25).

use std::fmt;

use crate::error::ValidationError;

use super::*;

/// A validated worker id (R10): trimmed, 1 to 255 characters of `[A-Za-z0-9.\-/:]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId(String);

impl WorkerId {
    /// Validates a worker id; anything else is `Invalid worker_id format: '<value>'`.
    pub fn new(v: impl AsRef<str>) -> Result<Self, ValidationError> {
        let raw = v.as_ref();
        let t = trim_ancestor(raw);
        let ok = !t.is_empty()
            && t.chars().count() <= limits::WORKER_ID_MAX
            && t.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '/' | ':'));
        if ok {
            Ok(Self(t.to_owned()))
        } else {
            Err(ValidationError::WorkerId(raw.to_owned()))
        }
    }

    /// A worker id unique per process start: `relay-<host>-<pid>-<random>` (R25).
    pub fn generate() -> Self {
        let host = std::env::var("HOSTNAME")
            .ok()
            .map(|h| {
                h.chars()
                    .filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '.')
                    .take(64)
                    .collect::<String>()
            })
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "host".into());
        let nonce: u32 = rand::random();
        Self(format!("relay-{host}-{}-{nonce:08x}", std::process::id()))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for WorkerId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}
