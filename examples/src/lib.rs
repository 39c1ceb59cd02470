#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

/// `url` with its password replaced by `***` (`scheme://user:***@host/...`), for log lines and
/// error messages. A URL without a password, or text that is no URL, comes back unchanged.
/// Comma-separated URLs (NATS server lists) are redacted one by one.
pub fn redact_url(url: &str) -> String {
    url.split(',').map(redact_one).collect::<Vec<_>>().join(",")
}

fn redact_one(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_owned();
    };
    let rest = &url[scheme_end + 3..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let Some(at) = authority.rfind('@') else {
        return url.to_owned();
    };
    let userinfo = &authority[..at];
    let redacted = match userinfo.find(':') {
        Some(colon) => format!("{}:***", &userinfo[..colon]),
        // `redis://secret@host`: the lone userinfo is the password for Redis and a token for
        // NATS; hide it too.
        None if !userinfo.is_empty() => "***".to_owned(),
        None => return url.to_owned(),
    };
    format!("{}{}{}", &url[..scheme_end + 3], redacted, &rest[at..])
}

/// `text` with every occurrence of `url` (and of each of its comma-separated parts) replaced by
/// its [`redact_url`] form.
pub fn redact_urls_in(text: &str, url: &str) -> String {
    let mut out = text.replace(url, &redact_url(url));
    for part in url.split(',') {
        out = out.replace(part, &redact_one(part));
    }
    out
}

/// The default worker id of a relay process: `{host}-{pid}`, with every character that R10 does
/// not allow (`^[A-Za-z0-9.\-/:]+$`) replaced by `-`, cut to 255 characters.
pub fn default_worker_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "relay".to_owned());
    let raw = format!("{host}-{}", std::process::id());
    sanitize_worker_id(&raw)
}

/// Replaces characters a worker id may not hold (R10) by `-` and cuts it to 255 characters.
pub fn sanitize_worker_id(raw: &str) -> String {
    raw.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '/' | ':') {
                c
            } else {
                '-'
            }
        })
        .take(255)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_worker_id_is_valid() {
        let id = default_worker_id();
        assert!(outbox_core::WorkerId::new(id.clone()).is_ok(), "{id}");
        assert!(id.ends_with(&format!("-{}", std::process::id())));
    }

    #[test]
    fn urls_lose_their_passwords() {
        assert_eq!(
            redact_url("postgres://app:s3cret@db:5432/x?sslmode=require"),
            "postgres://app:***@db:5432/x?sslmode=require"
        );
        assert_eq!(
            redact_url("redis://:pw@127.0.0.1:6379"),
            "redis://:***@127.0.0.1:6379"
        );
        assert_eq!(redact_url("redis://token@r:6379"), "redis://***@r:6379");
        assert_eq!(
            redact_url("nats://a:b@n1:4222,nats://n2:4222"),
            "nats://a:***@n1:4222,nats://n2:4222"
        );
        assert_eq!(redact_url("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
        assert_eq!(
            redact_urls_in("cannot reach nats://u:p@h:1 now", "nats://u:p@h:1"),
            "cannot reach nats://u:***@h:1 now"
        );
    }

    #[test]
    fn sanitize_replaces_forbidden_characters() {
        assert_eq!(sanitize_worker_id("my host_1 (x)"), "my-host-1--x-");
        assert_eq!(sanitize_worker_id(&"a".repeat(300)).len(), 255);
    }
}
