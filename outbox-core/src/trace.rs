//! W3C trace context across the broker.
//!
//! An event may carry the [W3C `traceparent`](https://www.w3.org/TR/trace-context/) of the
//! code that wrote it ([`EventBuilder::traceparent`](crate::EventBuilder::traceparent)). It is
//! stored with the row as the header [`TRACEPARENT`] in the `headers` JSON column, so the table
//! keeps its columns (the ancestor's table works unchanged) and every backend stores it alike.
//! The relay sends it on: the header `traceparent` on NATS, the field `traceparent` on Redis
//! Streams, the attribute `traceparent` of [`Message`](crate::Message) for any adapter. A
//! consumer that reads it continues the producer's trace: its spans get the producer's trace id
//! and the producer's span as their parent.
//!
//! The relay's publish span (`process <event type>`) records the stored context in the field
//! `messaging.traceparent`, next to the OpenTelemetry messaging attributes
//! `messaging.system`, `messaging.destination.name` and `messaging.message.id`.
//!
#![cfg_attr(
    feature = "opentelemetry",
    doc = "With the feature `opentelemetry`, [`EventBuilder::current_trace_context`](crate::EventBuilder::current_trace_context)"
)]
#![cfg_attr(
    not(feature = "opentelemetry"),
    doc = "With the feature `opentelemetry`, `EventBuilder::current_trace_context` (not built without it)"
)]
//! captures the current span's context (through tracing-opentelemetry) instead of an explicit
//! value, and the publish span also gets an OpenTelemetry link to the stored context, so a
//! trace backend shows the relay's publish next to the producer's span.
//!
//! The header key `traceparent` is reserved: a value given through
//! [`EventBuilder::header`](crate::EventBuilder::header) is validated as strictly as one given
//! through [`EventBuilder::traceparent`](crate::EventBuilder::traceparent).

use std::fmt;

use crate::error::ValidationError;

/// The reserved header key (and NATS header, Redis field) that carries the trace context.
pub const TRACEPARENT: &str = "traceparent";

/// A validated W3C `traceparent` value: `version-trace_id-parent_id-trace_flags`, lowercase hex,
/// e.g. `00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TraceParent(String);

impl TraceParent {
    /// Validates a `traceparent` (surrounding whitespace trimmed): version 2 hex digits other
    /// than `ff`; trace id 32 hex digits, not all zero; parent id 16 hex digits, not all zero;
    /// flags 2 hex digits; all lowercase. Version `00` has exactly these four parts; a later
    /// version may append `-…` parts, which are kept.
    pub fn parse(value: &str) -> Result<Self, ValidationError> {
        let v = value.trim();
        problem(v).map_or_else(
            || Ok(Self(v.to_owned())),
            |p| {
                Err(ValidationError::Header {
                    key: TRACEPARENT.into(),
                    problem: format!(
                        "{p}; a W3C traceparent is 00-<32 hex trace id>-<16 hex parent span id>-<2 hex flags> in lowercase, e.g. 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
                    ),
                })
            },
        )
    }

    /// The value.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The trace id (32 hex digits).
    pub fn trace_id(&self) -> &str {
        &self.0[3..35]
    }

    /// The parent span id (16 hex digits): the span of the producer that wrote the event.
    pub fn parent_id(&self) -> &str {
        &self.0[36..52]
    }

    /// Whether the producer sampled the trace (flag bit 0).
    pub fn sampled(&self) -> bool {
        u8::from_str_radix(&self.0[53..55], 16).is_ok_and(|f| f & 1 == 1)
    }
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for TraceParent {
    type Err = ValidationError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// The W3C trace context of the current `tracing` span, through tracing-opentelemetry (feature
/// `opentelemetry`); `None` when the current span has no valid OpenTelemetry context (no
/// tracing-opentelemetry layer, or no span).
#[cfg(feature = "opentelemetry")]
pub fn current() -> Option<TraceParent> {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let cx = tracing::Span::current().context();
    let span = cx.span();
    let sc = span.span_context();
    sc.is_valid().then(|| {
        TraceParent(format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8()
        ))
    })
}

/// The OpenTelemetry span context of a stored `traceparent` (remote: it came from another
/// process), for a link or a parent (feature `opentelemetry`).
#[cfg(feature = "opentelemetry")]
pub fn span_context(tp: &TraceParent) -> opentelemetry::trace::SpanContext {
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
    let flags = u8::from_str_radix(&tp.0[53..55], 16).unwrap_or(0);
    SpanContext::new(
        TraceId::from_hex(tp.trace_id()).unwrap_or(TraceId::INVALID),
        SpanId::from_hex(tp.parent_id()).unwrap_or(SpanId::INVALID),
        TraceFlags::new(flags),
        true,
        TraceState::default(),
    )
}

fn lower_hex(s: &str) -> bool {
    s.bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn problem(v: &str) -> Option<String> {
    let b = v.as_bytes();
    if b.len() < 55 {
        return Some(format!("{v:?} is {} characters long, not 55", v.len()));
    }
    if b[2] != b'-' || b[35] != b'-' || b[52] != b'-' {
        return Some(format!(
            "{v:?} does not have its parts at the W3C positions"
        ));
    }
    let (version, trace, parent, flags) = (&v[0..2], &v[3..35], &v[36..52], &v[53..55]);
    for (name, part) in [
        ("version", version),
        ("trace id", trace),
        ("parent id", parent),
        ("flags", flags),
    ] {
        if !lower_hex(part) {
            return Some(format!("the {name} {part:?} is not lowercase hex"));
        }
    }
    if version == "ff" {
        return Some("version ff is forbidden".into());
    }
    if version == "00" && b.len() != 55 {
        return Some(format!(
            "{v:?} is {} characters long; version 00 has exactly 55",
            v.len()
        ));
    }
    if b.len() > 55 && b[55] != b'-' {
        return Some(format!("{v:?} continues after the flags without '-'"));
    }
    if trace.bytes().all(|c| c == b'0') {
        return Some("the trace id is all zeros (invalid)".into());
    }
    if parent.bytes().all(|c| c == b'0') {
        return Some("the parent id is all zeros (invalid)".into());
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_parses_into_its_parts() {
        let t = TraceParent::parse(&format!("  {TP} ")).unwrap();
        assert_eq!(t.as_str(), TP);
        assert_eq!(t.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(t.parent_id(), "00f067aa0ba902b7");
        assert!(t.sampled());
        assert!(
            !TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00")
                .unwrap()
                .sampled()
        );
        // A later version may carry more parts.
        assert!(TraceParent::parse(&format!("01{}-extra", &TP[2..])).is_ok());
    }

    #[test]
    fn malformed_traceparents_are_refused_with_the_expected_format() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
        ] {
            let e = TraceParent::parse(bad).unwrap_err().to_string();
            assert!(
                e.contains("traceparent") && e.contains("00-<32 hex"),
                "{bad}: {e}"
            );
        }
    }
}
