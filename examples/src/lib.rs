#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

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
        assert!(txoutbox_core::WorkerId::new(id.clone()).is_ok(), "{id}");
        assert!(id.ends_with(&format!("-{}", std::process::id())));
    }

    #[test]
    fn sanitize_replaces_forbidden_characters() {
        assert_eq!(sanitize_worker_id("my host_1 (x)"), "my-host-1--x-");
        assert_eq!(sanitize_worker_id(&"a".repeat(300)).len(), 255);
    }
}
