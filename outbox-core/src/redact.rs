//! Passwords out of URLs before they reach a log line or an error message.
//!
//! Connection URLs carry credentials (`postgres://app:secret@db/app`,
//! `redis://:secret@cache:6379`, `nats://user:secret@bus:4222`). Every crate of this workspace
//! passes a URL, or a driver's error text that may quote one, through [`secrets`] before it
//! prints it.

/// The text with the password of every URL in it replaced by `***`: the part after the first
/// `:` of the user information (`scheme://user:password@host`), and the value of a query
/// parameter whose name holds `password`, `pass`, `secret` or `token`
/// (`?password=…`, `&sslpassword=…`). A user name alone is kept; the rest is unchanged.
///
/// Works on a single URL, a comma-separated list of URLs (NATS), or any text that quotes URLs.
///
/// ```
/// use txoutbox_core::redact::secrets;
/// assert_eq!(secrets("postgres://app:s3cret@db:5432/app"), "postgres://app:***@db:5432/app");
/// assert_eq!(secrets("redis://:s3cret@cache:6379"), "redis://:***@cache:6379");
/// assert_eq!(
///     secrets("postgres://db/app?user=app&password=s3cret"),
///     "postgres://db/app?user=app&password=***"
/// );
/// assert_eq!(secrets("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
/// ```
pub fn secrets(text: &str) -> String {
    query_secrets(&userinfo_secrets(text))
}

/// A character that ends the authority part of a URL inside free text.
fn ends_authority(c: char) -> bool {
    c.is_whitespace()
        || matches!(
            c,
            '/' | '?' | '#' | '"' | '\'' | ',' | '>' | '<' | ')' | '`'
        )
}

fn userinfo_secrets(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("://") {
        let start = i + 3;
        out.push_str(&rest[..start]);
        let after = &rest[start..];
        let end = after.find(ends_authority).unwrap_or(after.len());
        let authority = &after[..end];
        match authority.rfind('@') {
            Some(at) => {
                let userinfo = &authority[..at];
                match userinfo.find(':') {
                    Some(colon) => {
                        out.push_str(&userinfo[..=colon]);
                        out.push_str("***");
                    }
                    None => out.push_str(userinfo),
                }
                out.push_str(&authority[at..]);
            }
            None => out.push_str(authority),
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

fn secret_param(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    ["password", "pass", "secret", "token"]
        .iter()
        .any(|s| n.ends_with(s))
}

fn query_secrets(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    // A parameter starts after `?` or `&`: name `=` value, the value up to `&`, `#` or a space.
    while let Some(i) = rest.find(['?', '&']) {
        out.push_str(&rest[..=i]);
        let after = &rest[i + 1..];
        let name_end = after
            .find(|c: char| c == '=' || c == '&' || c == '?' || ends_authority(c))
            .unwrap_or(after.len());
        let name = &after[..name_end];
        if after[name_end..].starts_with('=') && !name.is_empty() && secret_param(name) {
            out.push_str(name);
            out.push_str("=***");
            let value = &after[name_end + 1..];
            let value_end = value
                .find(|c: char| c == '&' || c == '#' || c.is_whitespace() || c == '"' || c == '\'')
                .unwrap_or(value.len());
            rest = &value[value_end..];
        } else {
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::secrets;

    #[test]
    fn the_password_of_the_user_information_is_replaced() {
        assert_eq!(
            secrets("postgres://app:pw@127.0.0.1:5432/db"),
            "postgres://app:***@127.0.0.1:5432/db"
        );
        assert_eq!(secrets("rediss://:pw@h:6380/0"), "rediss://:***@h:6380/0");
        // A password holding `@` and `:`: everything up to the last `@` is user information.
        assert_eq!(secrets("postgres://u:p@ss:w@h/db"), "postgres://u:***@h/db");
    }

    #[test]
    fn a_list_of_urls_and_urls_inside_text_are_all_redacted() {
        assert_eq!(
            secrets("nats://a:pw1@h1:4222,nats://b:pw2@h2:4222"),
            "nats://a:***@h1:4222,nats://b:***@h2:4222"
        );
        assert_eq!(
            secrets("could not connect to \"redis://u:pw@h:1\": refused"),
            "could not connect to \"redis://u:***@h:1\": refused"
        );
    }

    #[test]
    fn query_parameters_that_carry_secrets_are_replaced() {
        assert_eq!(
            secrets("postgres://h/db?sslmode=require&password=pw&application_name=x"),
            "postgres://h/db?sslmode=require&password=***&application_name=x"
        );
        assert_eq!(secrets("nats://h?token=abc"), "nats://h?token=***");
    }

    #[test]
    fn text_without_secrets_is_unchanged() {
        for t in [
            "postgres://app@h/db",
            "nats://127.0.0.1:4222",
            "plain text: a = b & c?",
            "",
            "é://ü@x",
        ] {
            assert_eq!(secrets(t), t);
        }
    }
}
