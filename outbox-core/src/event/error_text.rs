//! The texts stored as `last_error`: a failure's normalized text (R9) and a force-unlock
//! reason (R66).

use crate::error::ValidationError;

use super::*;

/// Normalizes a failure text for last_error (R9): trimmed, `Unknown error` when empty, and cut
/// on a character boundary with the suffix `... [TRUNCATED]` when longer than `max_bytes`.
pub fn normalize_error(text: &str, max_bytes: usize) -> String {
    let t = trim_ancestor(text);
    if t.is_empty() {
        return limits::UNKNOWN_ERROR.to_owned();
    }
    if t.len() <= max_bytes {
        return t.to_owned();
    }
    let budget = max_bytes.saturating_sub(limits::TRUNCATED_SUFFIX.len());
    let mut end = budget.min(t.len());
    while !t.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{}", &t[..end], limits::TRUNCATED_SUFFIX)
}

/// Validates an `error_max_length` setting (R9): greater than the 15-byte truncation suffix
/// and at most [`limits::ERROR_MAX_LENGTH_MAX`] (2,000 bytes, the size of the `last_error`
/// column).
pub fn check_error_max_length(v: usize) -> Result<usize, crate::error::ConfigError> {
    if v <= limits::TRUNCATED_SUFFIX.len() {
        return Err(crate::error::ConfigError::new(format!(
            "error_max_length must be greater than {} (the length of the truncation suffix), got {v}",
            limits::TRUNCATED_SUFFIX.len()
        )));
    }
    if v > limits::ERROR_MAX_LENGTH_MAX {
        return Err(crate::error::ConfigError::new(format!(
            "error_max_length must be at most {} bytes (the size of the last_error column, varchar({})), got {v}; a longer text could not be stored",
            limits::ERROR_MAX_LENGTH_MAX,
            limits::ERROR_MAX_LENGTH_MAX
        )));
    }
    Ok(v)
}

/// Validates a force-unlock reason (R66) and returns the text stored as last_error.
pub fn force_unlock_text(reason: &str) -> Result<String, ValidationError> {
    let r = trim_ancestor(reason);
    if r.is_empty() {
        return Err(ValidationError::Argument(
            "force_unlock reason must not be empty".into(),
        ));
    }
    let n = r.chars().count();
    if n > limits::FORCE_UNLOCK_REASON_MAX {
        return Err(ValidationError::Argument(format!(
            "force_unlock reason is {n} characters long; the limit is {}",
            limits::FORCE_UNLOCK_REASON_MAX
        )));
    }
    Ok(format!("Force unlock: {r}"))
}
