//! What one row becomes on AMQP 0-9-1 (R89, and R91's AMQP binding).

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use txoutbox_core::cloudevents::{self, MessageFormat};
use txoutbox_core::{BrokerError, Message};

use crate::config::{MAX_ROUTING_KEY_BYTES, RabbitMqBrokerConfig};

/// The prefix of the CloudEvents attribute headers in the AMQP binding.
pub const CLOUDEVENTS_HEADER_PREFIX: &str = "cloudEvents_";

/// The content type of every body (R50: the payload's compact JSON).
pub const CONTENT_TYPE: &str = "application/json";

/// delivery_mode 2: the broker writes the message to disk on a durable queue.
pub const PERSISTENT: u8 = 2;

/// The routing key of a message (prefix + topic), or a rejection when AMQP cannot carry it.
pub fn routing_key(config: &RabbitMqBrokerConfig, m: &Message) -> Result<String, BrokerError> {
    let key = config.routing_key(&m.topic);
    if key.len() > MAX_ROUTING_KEY_BYTES {
        return Err(BrokerError::rejected(format!(
            "RabbitMQ: routing key {key:?} is longer than {MAX_ROUTING_KEY_BYTES} bytes"
        )));
    }
    Ok(key)
}

/// The headers table: R50's attributes as long strings, plus under `cloudevents` the
/// `cloudEvents_*` attributes (which override an event header of the same name).
pub fn headers(config: &RabbitMqBrokerConfig, m: &Message) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in &m.attributes {
        t.insert(ShortString::from(k.clone()), long_string(v));
    }
    if config.message_format == MessageFormat::CloudEvents {
        let source = config.cloudevents_source.as_deref().unwrap_or_default();
        for (name, value) in cloudevents::attributes(m, source) {
            t.insert(
                ShortString::from(format!("{CLOUDEVENTS_HEADER_PREFIX}{name}")),
                long_string(&value),
            );
        }
    }
    t
}

/// The properties: delivery_mode 2, content_type `application/json`, message_id = event id,
/// type = event_type when it fits in 255 bytes, app_id when configured, and the headers. No
/// correlation_id property: AMQP's names the request a reply answers, so the event's
/// correlation id travels as the `correlation_id` header only.
pub fn properties(config: &RabbitMqBrokerConfig, m: &Message) -> BasicProperties {
    let mut p = BasicProperties::default()
        .with_delivery_mode(PERSISTENT)
        .with_content_type(ShortString::from(CONTENT_TYPE))
        .with_message_id(ShortString::from(m.event_id.hyphenated().to_string()))
        .with_headers(headers(config, m));
    if m.event_type.len() <= MAX_ROUTING_KEY_BYTES {
        p = p.with_type(ShortString::from(m.event_type.clone()));
    }
    if let Some(a) = &config.app_id {
        p = p.with_app_id(ShortString::from(a.clone()));
    }
    p
}

fn long_string(v: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(v.as_bytes().to_vec()))
}
