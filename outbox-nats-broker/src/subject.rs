//! NATS subject rules for publishing: tokens separated by `.`, none empty, no whitespace or
//! control characters, no wildcards (`*`, `>`).

/// Why `token` cannot be one token of a subject, if it cannot.
pub(crate) fn token_problem(token: &str) -> Option<String> {
    if token.is_empty() {
        return Some(
            "it has an empty token (two dots in a row, or a leading or trailing dot)".into(),
        );
    }
    if let Some(c) = token.chars().find(|c| c.is_whitespace() || c.is_control()) {
        return Some(format!(
            "it contains the whitespace or control character {c:?}"
        ));
    }
    if token.contains('.') {
        return Some("it contains a dot, which separates tokens".into());
    }
    if token.contains(['*', '>']) {
        return Some(
            "it contains a wildcard (`*` or `>`), which a published subject cannot".into(),
        );
    }
    None
}

/// Why `subject` cannot be published to, if it cannot.
pub(crate) fn subject_problem(subject: &str) -> Option<String> {
    if subject.is_empty() {
        return Some("it is empty".into());
    }
    subject.split('.').find_map(token_problem)
}

/// `token` with every character that a token cannot hold (`.`, `*`, `>`, whitespace, control
/// characters) replaced by `_`.
pub(crate) fn sanitize_token(token: &str) -> String {
    token
        .chars()
        .map(|c| {
            if c == '.' || c == '*' || c == '>' || c.is_whitespace() || c.is_control() {
                '_'
            } else {
                c
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects() {
        assert_eq!(subject_problem("orders"), None);
        assert_eq!(subject_problem("outbox.orders.created"), None);
        assert!(subject_problem("").is_some());
        assert!(subject_problem("a..b").is_some());
        assert!(subject_problem(".a").is_some());
        assert!(subject_problem("a.").is_some());
        assert!(subject_problem("a b").is_some());
        assert!(subject_problem("a\tb").is_some());
        assert!(subject_problem("a.*").is_some());
        assert!(subject_problem("a.>").is_some());
    }

    #[test]
    fn tokens() {
        assert_eq!(token_problem("acct-1"), None);
        assert!(token_problem("a.b").is_some());
        assert_eq!(sanitize_token("a.b c*>d"), "a_b_c__d");
        assert_eq!(token_problem(&sanitize_token("x.y z")), None);
    }
}
