//! The Kafka broker under test, shared by the test files of this crate: the broker at
//! `KAFKA_BROKERS` (default `127.0.0.1:9092`, the Tansu broker `.ci/run` starts), probed once
//! per test binary for its capabilities.
#![allow(dead_code)]

pub use std::net::{SocketAddr, ToSocketAddrs};
pub use std::sync::Arc;
pub use std::time::Duration;

pub use async_trait::async_trait;
use krafka::Kafka;
use krafka::admin::{CreateTopicsOptions, NewTopic};
use krafka::consumer::{AutoOffsetReset, IsolationLevel};
use tokio::sync::OnceCell;
pub use txoutbox_conformance::broker::fresh_suffix;
use txoutbox_conformance::kafka::{
    KafkaAdapter, KafkaCapability, KafkaRecord, KafkaUnderTest, PrivateBroker,
};
pub use txoutbox_core::Broker;
pub use txoutbox_kafka_broker::{Idempotence, KafkaBroker, KafkaBrokerConfig, MessageFormat};

/// The bootstrap brokers.
pub fn brokers() -> String {
    std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

/// A plain client of the broker.
pub async fn admin_client() -> Kafka {
    client_at(&brokers()).await
}

/// A plain client of the broker bootstrapped at `bootstrap`.
pub async fn client_at(bootstrap: &str) -> Kafka {
    Kafka::builder(bootstrap.to_owned())
        .client_id("outbox-test-admin")
        .request_timeout(Duration::from_secs(4))
        .connect_timeout(Duration::from_secs(2))
        .connect()
        .await
        .unwrap_or_else(|e| panic!("Kafka at {bootstrap} is unreachable: {e}"))
}

pub async fn create_topic(name: &str, partitions: i32, configs: &[(&str, &str)]) {
    create_topic_at(&brokers(), name, partitions, configs).await
}

pub async fn create_topic_at(
    bootstrap: &str,
    name: &str,
    partitions: i32,
    configs: &[(&str, &str)],
) {
    let admin = client_at(bootstrap).await.admin();
    let mut t = NewTopic::new(name, partitions, 1).expect("topic spec");
    for (k, v) in configs {
        t = t.with_config(*k, *v);
    }
    for (n, r) in admin
        .create_topics([t], CreateTopicsOptions::default())
        .await
        .expect("create topics")
    {
        r.unwrap_or_else(|e| panic!("create topic {n}: {e}"));
    }
}

pub async fn delete_topic(name: &str) {
    let admin = admin_client().await.admin();
    let _ = admin.delete_topics([name], Default::default()).await;
}

/// Every record of a topic, all partitions from the start, read_committed.
pub async fn read_topic(topic: &str) -> Vec<KafkaRecord> {
    read_topic_at(&brokers(), topic).await
}

/// The same from the broker bootstrapped at `bootstrap`.
pub async fn read_topic_at(bootstrap: &str, topic: &str) -> Vec<KafkaRecord> {
    let kafka = client_at(bootstrap).await;
    let consumer = kafka
        .consumer_without_group()
        .auto_offset_reset(AutoOffsetReset::Earliest)
        .isolation_level(IsolationLevel::ReadCommitted)
        .build()
        .await
        .expect("consumer");
    let producer_meta = kafka
        .producer()
        .idempotent(false)
        .build()
        .await
        .expect("meta producer");
    let parts: Vec<i32> = producer_meta
        .partitions_for(topic)
        .await
        .expect("partitions")
        .iter()
        .map(|p| p.partition)
        .collect();
    let mut out = Vec::new();
    for p in parts {
        let (_, high) = consumer
            .fetch_watermarks(topic, p)
            .await
            .expect("watermarks");
        if high <= 0 {
            continue;
        }
        consumer.assign(topic, vec![p]).await.expect("assign");
        consumer.seek_to_beginning(topic, p).await.expect("seek");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut last = -1;
        while last + 1 < high {
            assert!(
                std::time::Instant::now() < deadline,
                "reading {topic}/{p} took over 10 s"
            );
            for r in consumer
                .poll(Duration::from_millis(500))
                .await
                .expect("poll")
            {
                last = r.offset;
                out.push(KafkaRecord {
                    partition: r.partition,
                    offset: r.offset,
                    key: r.key.map(|k| k.to_vec()),
                    value: r.value.map(|v| v.to_vec()),
                    headers: r
                        .headers
                        .iter()
                        .map(|(k, v)| (k.clone(), v.as_ref().map(|v| v.to_vec())))
                        .collect(),
                });
            }
        }
    }
    let _ = consumer.close().await;
    let _ = producer_meta.close().await;
    out.sort_by_key(|r| (r.partition, r.offset));
    out
}

static CAPABILITIES: OnceCell<Vec<KafkaCapability>> = OnceCell::const_new();

/// Probes what the broker does, once per test binary, and prints it.
pub async fn capabilities() -> Vec<KafkaCapability> {
    CAPABILITIES
        .get_or_init(|| async {
            let mut caps = Vec::new();
            let kafka = admin_client().await;
            // idempotent_producer: InitProducerId granted, and a record sent under it stored.
            let probe = format!("ob.probe-idem-{}", fresh_suffix());
            create_topic(&probe, 1, &[]).await;
            match kafka
                .producer()
                .idempotent(true)
                .delivery_timeout(Duration::from_secs(5))
                .build()
                .await
            {
                Ok(p) => {
                    match p
                        .send(krafka::Record::new(probe.clone(), b"{}".to_vec()))
                        .await
                    {
                        Ok(_) => caps.push(KafkaCapability::IdempotentProducer),
                        Err(e) => eprintln!("Kafka probe: an idempotent send failed ({e})"),
                    }
                    let _ = p.close().await;
                }
                Err(e) => eprintln!("Kafka probe: no idempotent producer ({e})"),
            }
            delete_topic(&probe).await;
            // topic_max_message_bytes: a topic with max.message.bytes 1024 refuses 2 KiB.
            let small = format!("ob.probe-small-{}", fresh_suffix());
            create_topic(&small, 1, &[("max.message.bytes", "1024")]).await;
            let p = kafka
                .producer()
                .idempotent(false)
                .delivery_timeout(Duration::from_secs(5))
                .build()
                .await
                .expect("producer");
            if p.send(krafka::Record::new(small.clone(), vec![b'x'; 2048]))
                .await
                .is_err()
            {
                caps.push(KafkaCapability::TopicMaxMessageBytes);
            }
            delete_topic(&small).await;
            // no_auto_create: asking for an unknown topic does not create it.
            let absent = format!("ob.probe-absent-{}", fresh_suffix());
            let _ = tokio::time::timeout(Duration::from_secs(3), p.partitions_for(&absent)).await;
            let topics = kafka
                .admin()
                .list_topics(Default::default())
                .await
                .expect("list topics");
            if !topics.contains(&absent) {
                caps.push(KafkaCapability::NoAutoCreate);
            } else {
                delete_topic(&absent).await;
            }
            let _ = p.close().await;
            txoutbox_conformance::kafka::report(&format!(
                "Kafka broker at {} declares: {:?}",
                brokers(),
                caps.iter().map(|c| c.name()).collect::<Vec<_>>()
            ));
            caps
        })
        .await
        .clone()
}

/// The Kafka broker under test.
pub struct TestKafka;

#[async_trait]
impl KafkaUnderTest for TestKafka {
    async fn capabilities(&self) -> Vec<KafkaCapability> {
        capabilities().await
    }

    fn server_addr(&self) -> SocketAddr {
        brokers()
            .split(',')
            .next()
            .expect("a broker")
            .to_socket_addrs()
            .expect("KAFKA_BROKERS resolves")
            .next()
            .expect("an address")
    }

    async fn create_topic(&self, name: &str, partitions: i32, configs: &[(&str, &str)]) {
        create_topic(name, partitions, configs).await
    }

    async fn delete_topic(&self, name: &str) {
        delete_topic(name).await
    }

    async fn read(&self, topic: &str) -> Vec<KafkaRecord> {
        read_topic(topic).await
    }

    async fn adapter(&self, o: &KafkaAdapter) -> (Arc<dyn Broker>, Result<(), String>) {
        let target = o.bootstrap.map_or_else(brokers, |a| a.to_string());
        let mut cfg = KafkaBrokerConfig::new(target)
            .topic_prefix(txoutbox_conformance::kafka::PREFIX)
            .idempotence(if o.idempotence {
                Idempotence::On
            } else {
                Idempotence::Off
            })
            .delivery_timeout(o.delivery_timeout)
            .connect_timeout(Duration::from_millis(500));
        if let Some(s) = &o.cloudevents_source {
            cfg = cfg
                .message_format(MessageFormat::CloudEvents)
                .cloudevents_source(s.clone());
        }
        let b = KafkaBroker::connect_lazy(cfg).expect("a valid configuration");
        let check = b.check().await.map_err(|e| e.to_string());
        (Arc::new(b), check)
    }

    async fn private_broker(&self, advertised: SocketAddr) -> Option<PrivateBroker> {
        if std::env::var_os("KAFKA_BROKERS").is_some() {
            return None;
        }
        let listen = txoutbox_conformance::broker::closed_port().await;
        let child = start_tansu(listen, advertised).await;
        Some(PrivateBroker {
            listen,
            guard: Box::new(std::sync::Mutex::new(child)),
        })
    }

    async fn create_topic_at(&self, bootstrap: SocketAddr, name: &str, partitions: i32) {
        create_topic_at(&bootstrap.to_string(), name, partitions, &[]).await
    }

    async fn read_at(&self, bootstrap: SocketAddr, topic: &str) -> Vec<KafkaRecord> {
        read_topic_at(&bootstrap.to_string(), topic).await
    }
}

/// Starts a private Tansu process (memory storage of its own, killed on drop) listening on
/// `listen` and advertising `advertised`, and waits until it accepts connections (10 s).
pub async fn start_tansu(listen: SocketAddr, advertised: SocketAddr) -> tokio::process::Child {
    let bin = tansu_binary();
    let child = tokio::process::Command::new(&bin)
        .args([
            "broker",
            "--listener-url",
            &format!("tcp://{listen}"),
            "--advertised-listener-url",
            &format!("tcp://{advertised}"),
            "--storage-engine",
            &format!("memory://tansu-{}/", fresh_suffix()),
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("start {}: {e}", bin.display()));
    for _ in 0..100 {
        if tokio::net::TcpStream::connect(listen).await.is_ok() {
            return child;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the private Tansu broker did not listen on {listen} within 10 s");
}

/// The Tansu binary: `TANSU_BIN`, else what `scripts/tansu path` prints.
pub fn tansu_binary() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("TANSU_BIN") {
        return p.into();
    }
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/tansu");
    let out = std::process::Command::new("bash")
        .arg(&script)
        .arg("path")
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "scripts/tansu path failed (run scripts/tansu install): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("path").trim().into()
}
