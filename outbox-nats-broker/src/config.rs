//! Settings of the NATS broker adapter.

use std::path::PathBuf;
use std::time::Duration;

use txoutbox_core::cloudevents::{self, MessageFormat};

use crate::error::NatsBrokerError;
use crate::subject::{subject_problem, token_problem};

/// Whether, and how, the partition key becomes the last token of the subject.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeyToken {
    /// Subject = prefix + topic (the default).
    #[default]
    Off,
    /// Subject = prefix + topic + `.` + partition key; a key that is not a valid subject token
    /// (it holds `.`, `*`, `>`, whitespace or a control character) makes the message a
    /// rejection.
    Validated,
    /// Subject = prefix + topic + `.` + the partition key with every character a token cannot
    /// hold replaced by `_`. Two keys may then share a subject; the `partition_key` header
    /// still tells them apart.
    Sanitized,
}

/// What the message body holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BodyFormat {
    /// The payload as compact JSON (R50; the default). Everything else is in the headers.
    #[default]
    Payload,
    /// A JSON envelope `{"event_id", "event_type", "topic", "partition_key", "attributes",
    /// "payload"}`, for consumers that cannot read headers. The headers are sent as well.
    Envelope,
}

/// Where JetStream keeps a stream created by [`StreamSpec`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StreamStorage {
    /// On disk (the default).
    #[default]
    File,
    /// In memory.
    Memory,
}

/// A stream the adapter creates at start-up when no stream of that name exists. An existing
/// stream is left as it is (its settings are not compared or changed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamSpec {
    pub(crate) name: String,
    pub(crate) subjects: Vec<String>,
    pub(crate) max_message_size: Option<i32>,
    pub(crate) duplicate_window: Option<Duration>,
    pub(crate) max_age: Option<Duration>,
    pub(crate) storage: StreamStorage,
}

impl StreamSpec {
    /// A stream named `name` covering the adapter's subject prefix followed by `>` (so the
    /// prefix must not be empty unless [`subjects`](Self::subjects) is set).
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            subjects: Vec::new(),
            max_message_size: None,
            duplicate_window: None,
            max_age: None,
            storage: StreamStorage::File,
        }
    }

    /// The stream's subjects (wildcards allowed), instead of prefix + `>`.
    pub fn subjects<S: Into<String>>(mut self, subjects: impl IntoIterator<Item = S>) -> Self {
        self.subjects = subjects.into_iter().map(Into::into).collect();
        self
    }

    /// The largest message the stream accepts, in bytes (server default: unlimited).
    pub fn max_message_size(mut self, bytes: i32) -> Self {
        self.max_message_size = Some(bytes);
        self
    }

    /// The duplicate window within which a republished event id is dropped (server default:
    /// 2 minutes). Make it longer than the longest time a row can stay locked after its
    /// publish (the relay's lease TTL, 300 s by default) to drop more redeliveries.
    pub fn duplicate_window(mut self, d: Duration) -> Self {
        self.duplicate_window = Some(d);
        self
    }

    /// How long the stream keeps a message (server default: forever).
    pub fn max_age(mut self, d: Duration) -> Self {
        self.max_age = Some(d);
        self
    }

    /// File or memory storage.
    pub fn storage(mut self, s: StreamStorage) -> Self {
        self.storage = s;
        self
    }

    /// The stream name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// Settings of [`crate::NatsBroker`]. [`validate`](Self::validate) (called by the
/// constructors) checks them. Its `Debug` output shows the URL with passwords replaced by `***`.
#[derive(Clone, PartialEq, Eq)]
pub struct NatsBrokerConfig {
    pub(crate) url: String,
    pub(crate) subject_prefix: String,
    pub(crate) key_token: KeyToken,
    pub(crate) body: BodyFormat,
    pub(crate) timeout: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) reconnect_delay_max: Duration,
    pub(crate) ensure_stream: Option<StreamSpec>,
    pub(crate) check_streams: bool,
    pub(crate) client_name: Option<String>,
    pub(crate) credentials_file: Option<PathBuf>,
    pub(crate) tls: NatsTls,
    pub(crate) message_format: MessageFormat,
    pub(crate) cloudevents_source: Option<String>,
}

/// TLS settings of a NATS connection (rustls; no OpenSSL). A `tls://` URL, or a server that
/// requires TLS, turns TLS on without any of them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NatsTls {
    /// Refuse to connect without TLS.
    pub required: bool,
    /// PEM file of the certificate authorities to trust besides the system's.
    pub root_certificates: Option<PathBuf>,
    /// PEM files of the client certificate and its key, for servers that verify clients.
    pub client_certificate: Option<(PathBuf, PathBuf)>,
}

impl std::fmt::Debug for NatsBrokerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsBrokerConfig")
            .field("url", &txoutbox_core::redact::secrets(&self.url))
            .field("subject_prefix", &self.subject_prefix)
            .field("key_token", &self.key_token)
            .field("body", &self.body)
            .field("timeout", &self.timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("reconnect_delay_max", &self.reconnect_delay_max)
            .field("ensure_stream", &self.ensure_stream)
            .field("check_streams", &self.check_streams)
            .field("client_name", &self.client_name)
            .field("credentials_file", &self.credentials_file)
            .field("tls", &self.tls)
            .field("message_format", &self.message_format)
            .field("cloudevents_source", &self.cloudevents_source)
            .finish()
    }
}

/// Default adapter timeout: the longest a publish waits for its acknowledgement.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// Default connect timeout.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default longest wait between two reconnect attempts.
pub const DEFAULT_RECONNECT_DELAY_MAX: Duration = Duration::from_secs(2);

impl NatsBrokerConfig {
    /// Settings for the server(s) at `url` (e.g. `nats://127.0.0.1:4222`; several separated by
    /// commas), with subject prefix `""`, no key token, the payload as body and a 10 s timeout.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            subject_prefix: String::new(),
            key_token: KeyToken::Off,
            body: BodyFormat::Payload,
            timeout: DEFAULT_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            reconnect_delay_max: DEFAULT_RECONNECT_DELAY_MAX,
            ensure_stream: None,
            check_streams: true,
            client_name: None,
            credentials_file: None,
            tls: NatsTls::default(),
            message_format: MessageFormat::Plain,
            cloudevents_source: None,
        }
    }

    /// `plain` (default) or `cloudevents` (R91, NATS binding, working draft 1.0.3: `ce-`
    /// headers with percent-encoded values, and `ce-datacontenttype`); the latter needs
    /// [`cloudevents_source`](Self::cloudevents_source). Checked by scenario K-18.
    pub fn message_format(mut self, f: MessageFormat) -> Self {
        self.message_format = f;
        self
    }

    /// The CloudEvents `source` of every event (a URI-reference, e.g. `/orders-service`).
    pub fn cloudevents_source(mut self, source: impl Into<String>) -> Self {
        self.cloudevents_source = Some(source.into());
        self
    }

    /// Authenticates with a NATS credentials file (`.creds`: a user JWT and its NKey seed, as
    /// `nsc` writes it). The file is read when connecting; an unreadable or malformed file is a
    /// [`NatsBrokerError::Config`].
    pub fn credentials_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.credentials_file = Some(path.into());
        self
    }

    /// TLS settings (see [`NatsTls`]).
    pub fn tls(mut self, tls: NatsTls) -> Self {
        self.tls = tls;
        self
    }

    /// The credentials file, if set.
    pub fn credentials_file_path(&self) -> Option<&std::path::Path> {
        self.credentials_file.as_deref()
    }

    /// The TLS settings.
    pub fn tls_settings(&self) -> &NatsTls {
        &self.tls
    }

    /// The text put before the topic, usually ending in `.` (e.g. `outbox.`): subject =
    /// prefix + topic.
    pub fn subject_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.subject_prefix = prefix.into();
        self
    }

    /// Whether the partition key becomes the last subject token.
    pub fn key_token(mut self, k: KeyToken) -> Self {
        self.key_token = k;
        self
    }

    /// What the body holds.
    pub fn body(mut self, b: BodyFormat) -> Self {
        self.body = b;
        self
    }

    /// The adapter's own bound on one publish, acknowledgement included (> 0). Keep it below
    /// the relay's publish timeout, so the adapter's error text, not the relay's timeout, is
    /// what a row records.
    pub fn timeout(mut self, d: Duration) -> Self {
        self.timeout = d;
        self
    }

    /// How long one connection attempt may take (> 0).
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d;
        self
    }

    /// The longest wait between two reconnect attempts after the connection was lost (the
    /// waits grow from 0 up to this).
    pub fn reconnect_delay_max(mut self, d: Duration) -> Self {
        self.reconnect_delay_max = d;
        self
    }

    /// Creates this stream at start-up when it does not exist.
    pub fn ensure_stream(mut self, s: StreamSpec) -> Self {
        self.ensure_stream = Some(s);
        self
    }

    /// The client name the server shows in its connection list.
    pub fn client_name(mut self, name: impl Into<String>) -> Self {
        self.client_name = Some(name.into());
        self
    }

    /// The server URL(s), as given (with any password: print
    /// [`txoutbox_core::redact::secrets`] of it, never the URL itself).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Whether [`NatsBroker::connect`](crate::NatsBroker::connect) and
    /// [`from_client`](crate::NatsBroker::from_client) check that a JetStream stream covers the
    /// adapter's subjects ([`NatsBroker::check_streams`](crate::NatsBroker::check_streams)), so
    /// a configuration that can never publish fails at start-up instead of in every row's
    /// `last_error`. On by default; turn it off only when the streams are created after the
    /// relay starts.
    pub fn check_streams(mut self, on: bool) -> Self {
        self.check_streams = on;
        self
    }

    /// The subjects every publish of this adapter falls under, as a JetStream filter: the
    /// prefix followed by `>` (every subject when the prefix is empty). `None` when the prefix
    /// does not end in `.`: then no wildcard names the adapter's subjects.
    pub fn subject_space(&self) -> Option<String> {
        if self.subject_prefix.is_empty() || self.subject_prefix.ends_with('.') {
            Some(format!("{}>", self.subject_prefix))
        } else {
            None
        }
    }

    /// The subject a message with this topic is published to when the key token is off.
    pub fn subject_for_topic(&self, topic: &str) -> String {
        format!("{}{}", self.subject_prefix, topic)
    }

    /// Checks every setting.
    pub fn validate(&self) -> Result<(), NatsBrokerError> {
        let bad = |m: String| Err(NatsBrokerError::Config(m));
        if self.url.trim().is_empty() {
            return bad("url must not be empty; give e.g. nats://127.0.0.1:4222".into());
        }
        if !self.subject_prefix.is_empty() {
            // The prefix plus any valid topic must be a valid subject.
            if let Some(p) = subject_problem(&format!("{}x", self.subject_prefix)) {
                return bad(format!(
                    "subject_prefix {:?} cannot start a subject: {p}",
                    self.subject_prefix
                ));
            }
        }
        if self.timeout.is_zero() {
            return bad("timeout must be > 0".into());
        }
        let files = self
            .credentials_file
            .iter()
            .map(|p| ("credentials file", p))
            .chain(
                self.tls
                    .root_certificates
                    .iter()
                    .map(|p| ("TLS root certificates", p)),
            )
            .chain(
                self.tls
                    .client_certificate
                    .iter()
                    .flat_map(|(c, k)| [("TLS client certificate", c), ("TLS client key", k)]),
            );
        for (what, path) in files {
            if !path.is_file() {
                return bad(format!(
                    "the {what} {} is not a readable file; check the path",
                    path.display()
                ));
            }
        }
        if self.connect_timeout.is_zero() {
            return bad("connect_timeout must be > 0".into());
        }
        if self.message_format == MessageFormat::CloudEvents {
            cloudevents::check_source(self.cloudevents_source.as_deref())
                .map_err(NatsBrokerError::Config)?;
        }
        if let Some(s) = &self.ensure_stream {
            if s.name.is_empty()
                || s.name.chars().any(|c| {
                    c == '.'
                        || c == '*'
                        || c == '>'
                        || c == '/'
                        || c == '\\'
                        || c.is_whitespace()
                        || c.is_control()
                })
            {
                return bad(format!(
                    "stream name {:?} must be non-empty without '.', '*', '>', '/', '\\' or whitespace",
                    s.name
                ));
            }
            if s.subjects.is_empty() && self.subject_prefix.is_empty() {
                return bad(
                    "ensure_stream without subjects needs a non-empty subject_prefix (the stream covers prefix + \">\"); set one, or give the stream's subjects".into(),
                );
            }
            for subj in &s.subjects {
                let bad_token = subj.is_empty()
                    || subj
                        .split('.')
                        .any(|t| t != "*" && t != ">" && token_problem(t).is_some());
                if bad_token {
                    return bad(format!(
                        "stream subject {subj:?} is not a valid subject filter"
                    ));
                }
            }
            if let Some(n) = s.max_message_size
                && n < 1
            {
                return bad(format!("stream max_message_size must be >= 1, got {n}"));
            }
        }
        Ok(())
    }

    pub(crate) fn stream_subjects(&self, s: &StreamSpec) -> Vec<String> {
        if s.subjects.is_empty() {
            vec![format!("{}>", self.subject_prefix)]
        } else {
            s.subjects.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_output_hides_the_password_of_the_url() {
        let c = NatsBrokerConfig::new("nats://app:s3cret-pw@127.0.0.1:4222");
        let d = format!("{c:?}");
        assert!(!d.contains("s3cret-pw") && d.contains("app:***@"), "{d}");
    }

    #[test]
    fn missing_credential_and_certificate_files_are_configuration_errors() {
        let c = NatsBrokerConfig::new("nats://127.0.0.1:4222")
            .credentials_file("/nonexistent/outbox.creds");
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("credentials file /nonexistent/outbox.creds"),
            "{e}"
        );
        let c = NatsBrokerConfig::new("nats://127.0.0.1:4222").tls(NatsTls {
            required: true,
            root_certificates: Some("/nonexistent/ca.pem".into()),
            client_certificate: None,
        });
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("TLS root certificates /nonexistent/ca.pem"),
            "{e}"
        );
    }

    #[test]
    fn cloudevents_needs_a_valid_source() {
        let c = NatsBrokerConfig::new("nats://127.0.0.1:4222")
            .message_format(MessageFormat::CloudEvents);
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("needs a cloudevents_source"), "{e}");
        let e = c
            .clone()
            .cloudevents_source("/a b")
            .validate()
            .unwrap_err()
            .to_string();
        assert!(e.contains("cloudevents_source \"/a b\""), "{e}");
        assert!(c.cloudevents_source("/orders-service").validate().is_ok());
        // The default format needs no source.
        assert!(NatsBrokerConfig::new("nats://x").validate().is_ok());
    }

    #[test]
    fn validation() {
        let ok = NatsBrokerConfig::new("nats://127.0.0.1:4222").subject_prefix("outbox.");
        assert!(ok.validate().is_ok());
        assert!(NatsBrokerConfig::new("").validate().is_err());
        assert!(ok.clone().subject_prefix("out box.").validate().is_err());
        assert!(ok.clone().subject_prefix("outbox..").validate().is_err());
        assert!(ok.clone().subject_prefix("outbox.*.").validate().is_err());
        assert!(ok.clone().timeout(Duration::ZERO).validate().is_err());
        assert!(
            ok.clone()
                .ensure_stream(StreamSpec::new("OUT"))
                .validate()
                .is_ok()
        );
        assert!(
            ok.clone()
                .ensure_stream(StreamSpec::new("a.b"))
                .validate()
                .is_err()
        );
        assert!(
            NatsBrokerConfig::new("nats://x")
                .ensure_stream(StreamSpec::new("OUT"))
                .validate()
                .is_err()
        );
        assert!(
            NatsBrokerConfig::new("nats://x")
                .ensure_stream(StreamSpec::new("OUT").subjects(["orders.>"]))
                .validate()
                .is_ok()
        );
        assert!(
            ok.ensure_stream(StreamSpec::new("OUT").max_message_size(0))
                .validate()
                .is_err()
        );
    }
}
