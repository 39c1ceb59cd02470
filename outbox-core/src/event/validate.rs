//! The text rules every write shares: the ancestor's whitespace and trimming, the header
//! rules (R6), and the insert window of an absolute schedule (R8, D2).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::error::ValidationError;

use super::*;

/// Whether `c` is whitespace to the ancestor: what Python's `str.isspace()` accepts, and so what
/// its `str.strip()` removes. That is Unicode White_Space (Rust's [`char::is_whitespace`]) plus
/// the information separators U+001C to U+001F, which Python also counts as whitespace.
pub fn is_ancestor_whitespace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// `s` without leading and trailing [ancestor whitespace](is_ancestor_whitespace): every text the
/// contract trims (R6, R7, R9, R10, R66) is trimmed this way, so a value accepted here reads back
/// the same through the ancestor's model.
pub fn trim_ancestor(s: &str) -> &str {
    s.trim_matches(is_ancestor_whitespace)
}

/// The window an absolute schedule must meet at insert (R8, D2): `[created_at − 60 s,
/// created_at + 365 days]`, created_at being the backend clock when the row is inserted. It is
/// the ancestor's load check with its default skew; a row outside it would make the ancestor's
/// relay fail on the whole table (R78). Backends call this (or do the same in SQL) before they
/// insert anything, and refuse the write with
/// [`ValidationError::ScheduleOutsideInsertWindow`].
pub fn check_insert_window(
    id: Uuid,
    at: DateTime<Utc>,
    created_at: DateTime<Utc>,
) -> Result<(), ValidationError> {
    let earliest =
        created_at - chrono::Duration::seconds(limits::DEFAULT_SCHEDULE_SKEW_SECS as i64);
    let latest = created_at + chrono::Duration::seconds(limits::SCHEDULE_MAX_AHEAD_SECS);
    if at < earliest || at > latest {
        return Err(ValidationError::ScheduleOutsideInsertWindow { id, at, created_at });
    }
    Ok(())
}

fn header_err(key: &str, problem: impl Into<String>) -> ValidationError {
    ValidationError::Header {
        key: key.to_owned(),
        problem: problem.into(),
    }
}

/// Validates headers (R6); an empty set becomes none.
pub fn validate_headers(
    raw: Vec<(String, String)>,
) -> Result<Option<BTreeMap<String, String>>, ValidationError> {
    if raw.len() > limits::HEADERS_MAX {
        return Err(ValidationError::TooManyHeaders {
            count: raw.len(),
            max: limits::HEADERS_MAX,
        });
    }
    let mut out = BTreeMap::new();
    let mut folded = std::collections::HashSet::new();
    for (k, v) in raw {
        let k = trim_ancestor(&k);
        let v = trim_ancestor(&v);
        if k.is_empty() {
            return Err(header_err(k, "key must not be empty or blank"));
        }
        let kn = k.chars().count();
        if kn > limits::HEADER_KEY_MAX {
            return Err(header_err(
                k,
                format!(
                    "key is {kn} characters long; the limit is {}",
                    limits::HEADER_KEY_MAX
                ),
            ));
        }
        if k.chars().any(|c| (c as u32) < 32 || c as u32 == 127) {
            return Err(header_err(k, "key contains a control character"));
        }
        if v.is_empty() {
            return Err(header_err(k, "value must not be empty or blank"));
        }
        let vn = v.chars().count();
        if vn > limits::HEADER_VALUE_MAX {
            return Err(header_err(
                k,
                format!(
                    "value is {vn} characters long; the limit is {}",
                    limits::HEADER_VALUE_MAX
                ),
            ));
        }
        if v.chars()
            .any(|c| ((c as u32) < 32 && c != '\t') || c as u32 == 127)
        {
            return Err(header_err(
                k,
                "value contains a control character (only TAB is allowed)",
            ));
        }
        if k.eq_ignore_ascii_case(crate::trace::TRACEPARENT) {
            if k != crate::trace::TRACEPARENT {
                return Err(header_err(
                    k,
                    "the reserved trace-context key is spelled `traceparent` (lowercase)",
                ));
            }
            crate::trace::TraceParent::parse(v)?;
        }
        if !folded.insert(k.to_lowercase()) {
            return Err(header_err(
                k,
                "duplicate key (keys must differ after trimming and ignoring case)",
            ));
        }
        out.insert(k.to_owned(), v.to_owned());
    }
    Ok(if out.is_empty() { None } else { Some(out) })
}
