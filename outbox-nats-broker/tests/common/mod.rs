//! The Nats broker under test, shared by the test files of this crate.
#![allow(dead_code)]

pub use std::collections::BTreeMap;
pub use std::net::{SocketAddr, ToSocketAddrs};
pub use std::sync::Arc;
pub use std::time::Duration;

pub use async_nats::jetstream;
pub use async_trait::async_trait;
pub use txoutbox_conformance::broker::{
    BrokerKind, BrokerTrial, BrokerUnderTest, Received, TrialOptions, fresh_suffix,
};
pub use txoutbox_core::Broker;
pub use txoutbox_nats_broker::{NatsBroker, NatsBrokerConfig};

pub fn url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

pub fn host_port(url: &str) -> String {
    url.trim_start_matches("nats://").to_owned()
}

pub struct Nats;

struct NatsTrial {
    broker: NatsBroker,
    config: NatsBrokerConfig,
    admin: jetstream::Context,
    stream: String,
    prefix: String,
}

#[async_trait]
impl BrokerUnderTest for Nats {
    fn kind(&self) -> BrokerKind {
        BrokerKind::Nats
    }

    fn server_addr(&self) -> SocketAddr {
        host_port(&url())
            .to_socket_addrs()
            .expect("NATS_URL resolves")
            .next()
            .expect("an address")
    }

    async fn trial(&self, opts: TrialOptions) -> Box<dyn BrokerTrial> {
        let suffix = fresh_suffix();
        let stream = format!("OUTBOX_TEST_{suffix}");
        let prefix = format!("outboxtest.{suffix}.");
        let admin_client = async_nats::connect(url())
            .await
            .unwrap_or_else(|e| panic!("NATS at {} is unreachable: {e}", url()));
        let admin = jetstream::new(admin_client);
        admin
            .create_stream(jetstream::stream::Config {
                name: stream.clone(),
                subjects: vec![format!("{prefix}>")],
                storage: jetstream::stream::StorageType::Memory,
                ..Default::default()
            })
            .await
            .expect("create the trial stream");
        let target = match opts.connect_to {
            Some(a) => format!("nats://{a}"),
            None => url(),
        };
        let cfg = NatsBrokerConfig::new(target)
            .subject_prefix(&prefix)
            .timeout(opts.adapter_timeout)
            .reconnect_delay_max(Duration::from_millis(200));
        let broker = NatsBroker::connect(cfg.clone())
            .await
            .expect("connect the adapter");
        Box::new(NatsTrial {
            broker,
            config: cfg,
            admin,
            stream,
            prefix,
        })
    }

    async fn unreachable(&self, addr: SocketAddr, adapter_timeout: Duration) -> Arc<dyn Broker> {
        let cfg = NatsBrokerConfig::new(format!("nats://{addr}"))
            .subject_prefix("outboxtest.unreachable.")
            .timeout(adapter_timeout);
        Arc::new(
            NatsBroker::connect_lazy(cfg)
                .await
                .expect("a lazy adapter needs no server"),
        )
    }
}

#[async_trait]
impl BrokerTrial for NatsTrial {
    fn broker(&self) -> Arc<dyn Broker> {
        Arc::new(self.broker.clone())
    }

    async fn another_adapter(&self) -> Arc<dyn Broker> {
        Arc::new(
            NatsBroker::connect(self.config.clone())
                .await
                .expect("connect another adapter"),
        )
    }

    fn destination(&self, topic: &str) -> String {
        format!("{}{topic}", self.prefix)
    }

    async fn read(&self, topic: &str) -> Vec<Received> {
        let subject = self.destination(topic);
        let stream = self
            .admin
            .get_stream(&self.stream)
            .await
            .expect("get the stream");
        let info = stream.get_info().await.expect("stream info");
        let mut out = Vec::new();
        if info.state.messages == 0 {
            return out;
        }
        for seq in info.state.first_sequence..=info.state.last_sequence {
            let m = stream
                .get_raw_message(seq)
                .await
                .expect("read a stored message");
            if m.subject.as_str() != subject
                && !m.subject.as_str().starts_with(&format!("{subject}."))
            {
                continue;
            }
            let mut attributes = BTreeMap::new();
            let mut message_id = None;
            for (name, values) in m.headers.iter() {
                let name = name.to_string();
                let value = values
                    .last()
                    .map(|v| v.as_str().to_owned())
                    .unwrap_or_default();
                if name.eq_ignore_ascii_case("Nats-Msg-Id") {
                    message_id = Some(value);
                } else if !name.to_ascii_lowercase().starts_with("nats-") {
                    attributes.insert(name, value);
                }
            }
            out.push(Received {
                destination: m.subject.to_string(),
                body: m.payload.to_vec(),
                attributes,
                message_id,
            });
        }
        out
    }

    async fn prepare_refusal(&self, _topic: &str) -> String {
        let mut stream = self
            .admin
            .get_stream(&self.stream)
            .await
            .expect("get the stream");
        let mut cfg = stream.info().await.expect("stream info").config.clone();
        cfg.max_message_size = 1024;
        self.admin
            .update_stream(cfg)
            .await
            .expect("set max message size 1024");
        "message size exceeds maximum allowed".into()
    }

    async fn await_reachable(&self, within: Duration) -> bool {
        self.broker.wait_connected(within).await
    }

    async fn cleanup(&self) {
        let _ = self.admin.delete_stream(&self.stream).await;
    }
}
