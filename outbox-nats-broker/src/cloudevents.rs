//! The NATS binding of the CloudEvents binary mode (R91, working draft 1.0.3 of the binding):
//! the attributes of [`txoutbox_core::cloudevents::attributes`] as `ce-` headers with
//! percent-encoded values, plus `ce-datacontenttype`. Checked by scenario K-18.

use async_nats::HeaderMap;
use txoutbox_core::Message;
use txoutbox_core::cloudevents;

/// The prefix of the CloudEvents attribute headers in the NATS binding.
pub const CLOUDEVENTS_HEADER_PREFIX: &str = "ce-";

/// A value as the NATS binding sends it: space, `"`, `%` and every character outside U+0021 to
/// U+007E become `%XY` for each byte of their UTF-8 form, in upper-case hex
/// (`order créé` → `order%20cr%C3%A9%C3%A9`).
pub fn percent_encode(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        if c != '"' && c != '%' && ('\u{21}'..='\u{7e}').contains(&c) {
            out.push(c);
        } else {
            let mut buf = [0u8; 4];
            for b in c.encode_utf8(&mut buf).bytes() {
                out.push_str(&format!("%{b:02X}"));
            }
        }
    }
    out
}

/// Adds (overriding an event header of the same name, as in R50) the `ce-` attribute headers
/// of `m` with `source` as its CloudEvents source.
pub(crate) fn add_headers(h: &mut HeaderMap, m: &Message, source: &str) {
    for (name, value) in cloudevents::attributes(m, source) {
        h.insert(
            format!("{CLOUDEVENTS_HEADER_PREFIX}{name}"),
            percent_encode(&value),
        );
    }
    h.insert(
        format!("{CLOUDEVENTS_HEADER_PREFIX}datacontenttype"),
        cloudevents::DATA_CONTENT_TYPE,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_percent_encoded_as_the_binding_says() {
        assert_eq!(percent_encode("order créé"), "order%20cr%C3%A9%C3%A9");
        assert_eq!(percent_encode("acct 1"), "acct%201");
        assert_eq!(percent_encode("a\"b%c"), "a%22b%25c");
        assert_eq!(percent_encode("tab\there\u{7f}"), "tab%09here%7F");
        assert_eq!(
            percent_encode("/orders-service:2026-12-01T10:15:30.123456Z~!"),
            "/orders-service:2026-12-01T10:15:30.123456Z~!"
        );
        assert_eq!(percent_encode("€"), "%E2%82%AC");
    }
}
