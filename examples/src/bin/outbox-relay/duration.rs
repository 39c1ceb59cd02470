//! Durations on the command line: `250ms`, `1.5s`, `5m`, `2h`, `7d`, or a bare number of
//! seconds.

use std::time::Duration;

/// Parses a duration (used as a clap value parser).
pub fn parse(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| {
        format!("{s:?} is not a duration; write e.g. 250ms, 1.5s, 5m, 2h or 7d (a bare number is seconds)")
    })?;
    let secs = match unit.trim() {
        "" | "s" => n,
        "ms" => n / 1000.0,
        "m" | "min" => n * 60.0,
        "h" => n * 3600.0,
        "d" => n * 86_400.0,
        other => {
            return Err(format!(
                "unknown duration unit {other:?} in {s:?}; use ms, s, m, h or d"
            ));
        }
    };
    if !secs.is_finite() || secs > 1e12 {
        return Err(format!("{s:?} is too long a duration"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units() {
        assert_eq!(parse("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse("2").unwrap(), Duration::from_secs(2));
        assert_eq!(parse("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(parse("7d").unwrap(), Duration::from_secs(7 * 86_400));
        assert!(parse("soon").is_err());
        assert!(parse("5y").is_err());
        assert!(parse("").is_err());
    }
}
