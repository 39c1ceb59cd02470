//! The broker shapes of `outbox-bench inbox` (issue 22): the runner on NATS JetStream
//! (`NatsSubscription`) and on Redis Streams (`RedisSubscription`), N messages over K keys
//! published beforehand to a fresh stream (or key prefix), handler writing one row, against the
//! raw broker consume of the same messages with an explicit ack per message and C acks in
//! flight (NATS: a second durable pull consumer, each message `double_ack`ed, the confirmed ack
//! the adapter's commit is; Redis: a second group, XREADGROUP batches of 64, one XACK per
//! entry), and against the scripted subscription on N messages in the same run.

#[cfg(any(feature = "nats", feature = "redis"))]
use std::sync::Arc;
#[cfg(any(feature = "nats", feature = "redis"))]
use std::time::Instant;

#[cfg(any(feature = "nats", feature = "redis"))]
use futures::StreamExt;
#[cfg(any(feature = "nats", feature = "redis"))]
use serde_json::json;

use crate::BenchError;
#[cfg(any(feature = "nats", feature = "redis"))]
use crate::inbox::{Bed, Ended, SOURCE, attrs, body, check, run_until, runner, scripted_rate};
use crate::inbox::{InboxArgs, InboxShape, Measured};

/// Measures one broker shape.
pub async fn measure(
    shape: InboxShape,
    a: &InboxArgs,
    lib_first: bool,
) -> Result<Measured, BenchError> {
    match shape {
        #[cfg(feature = "nats")]
        InboxShape::Nats => nats::measure(a, lib_first).await,
        #[cfg(feature = "redis")]
        InboxShape::Redis => redis_shape::measure(a, lib_first).await,
        other => {
            let _ = (a, lib_first);
            Err(BenchError(format!(
                "the {other:?} shape needs outbox-bench built with the broker's feature"
            )))
        }
    }
}

/// The library half of a broker shape: the runner on `sub` until N deliveries ended.
#[cfg(any(feature = "nats", feature = "redis"))]
async fn library(
    bed: &Bed,
    a: &InboxArgs,
    sub: Arc<dyn txoutbox_core::inbox::Subscription>,
) -> Result<f64, BenchError> {
    let (store, pool) = bed
        .store(&a.conn, (a.concurrency + 4) as u32, a.pool_ping)
        .await?;
    let ended = Arc::new(Ended::default());
    let r = runner(store, sub.clone(), &bed.lib, a.concurrency, ended.clone())?;
    let secs = run_until(r, &ended, a.broker_messages).await;
    sub.close().await;
    pool.close().await;
    let secs = secs?;
    check(
        a.broker_messages,
        bed.done(&bed.lib).await?,
        "broker runner",
    )?;
    Ok(secs)
}

#[cfg(any(feature = "nats", feature = "redis"))]
async fn both<L, R>(lib_first: bool, lib: L, reference: R) -> Result<(f64, f64), BenchError>
where
    L: std::future::Future<Output = Result<f64, BenchError>>,
    R: std::future::Future<Output = Result<f64, BenchError>>,
{
    if lib_first {
        let l = lib.await?;
        Ok((l, reference.await?))
    } else {
        let r = reference.await?;
        Ok((lib.await?, r))
    }
}

#[cfg(any(feature = "nats", feature = "redis"))]
fn measured(a: &InboxArgs, lib_s: f64, ref_s: f64, scripted: f64, broker: &str) -> Measured {
    let n = a.broker_messages as f64;
    Measured {
        library: n / lib_s,
        reference: n / ref_s,
        extra: json!({"broker": broker, "messages": a.broker_messages, "keys": a.keys,
            "concurrency": a.concurrency, "library_s": lib_s, "reference_s": ref_s,
            "scripted_per_s": scripted.round(), "vs_scripted": ((n / lib_s) / scripted * 1000.0).round() / 1000.0}),
        ..Measured::default()
    }
}

#[cfg(feature = "nats")]
mod nats {
    use std::time::Duration;

    use async_nats::jetstream::{self, consumer};
    use txoutbox_nats_broker::{NatsSubscription, NatsSubscriptionConfig};

    use super::*;

    fn err(what: &'static str) -> impl Fn(String) -> BenchError {
        move |e| BenchError(format!("NATS: {what} failed: {e}"))
    }

    pub async fn measure(a: &InboxArgs, lib_first: bool) -> Result<Measured, BenchError> {
        let url = &a.conn.nats_url;
        let client = async_nats::connect(url)
            .await
            .map_err(|e| BenchError(format!("NATS at {url} is unreachable: {e}")))?;
        let js = jetstream::new(client.clone());
        let tag = crate::inbox::run_tag("IBENCH");
        let prefix = format!("ibench.{tag}.");
        js.create_stream(jetstream::stream::Config {
            name: tag.clone(),
            subjects: vec![format!("{prefix}>")],
            ..Default::default()
        })
        .await
        .map_err(|e| err("creating the stream")(e.to_string()))?;
        let bed = Bed::create(&a.conn, 2).await;
        let res = async {
            let bed = bed.as_ref().map_err(|e| BenchError(e.0.clone()))?;
            publish(&js, &prefix, a).await?;
            let lib = async {
                let sub = NatsSubscription::bind(
                    client.clone(),
                    NatsSubscriptionConfig::new(&tag, "g")
                        .subject_prefix(&prefix)
                        .topics([SOURCE]),
                )
                .await
                .map_err(|e| err("binding the subscription")(e.to_string()))?;
                library(bed, a, Arc::new(sub)).await
            };
            let (lib_s, ref_s) = both(lib_first, lib, raw(&js, &tag, a)).await?;
            let scripted = scripted_rate(a, a.broker_messages).await?;
            Ok(measured(a, lib_s, ref_s, scripted, "nats"))
        }
        .await;
        if let Ok(b) = bed {
            b.drop().await;
        }
        let _ = js.delete_stream(&tag).await;
        res
    }

    async fn publish(
        js: &jetstream::Context,
        prefix: &str,
        a: &InboxArgs,
    ) -> Result<(), BenchError> {
        let subject = format!("{prefix}{SOURCE}");
        let results: Vec<Result<(), String>> = futures::stream::iter(0..a.broker_messages)
            .map(|i| {
                let subject = subject.clone();
                async move {
                    let (id, key) = attrs(i, a.keys);
                    let mut h = async_nats::HeaderMap::new();
                    h.insert("event_id", id.as_str());
                    h.insert("topic", SOURCE);
                    h.insert("event_type", "bench");
                    h.insert("partition_key", key.as_str());
                    let ack = js
                        .publish_with_headers(subject, h, body(i).into())
                        .await
                        .map_err(|e| e.to_string())?;
                    ack.await.map(|_| ()).map_err(|e| e.to_string())
                }
            })
            .buffer_unordered(256)
            .collect()
            .await;
        results
            .into_iter()
            .collect::<Result<Vec<()>, String>>()
            .map_err(err("publishing"))?;
        Ok(())
    }

    /// The raw consume: a durable pull consumer of its own, every message acked with a
    /// confirmed ack, C in flight.
    async fn raw(js: &jetstream::Context, stream: &str, a: &InboxArgs) -> Result<f64, BenchError> {
        let s = js
            .get_stream(stream)
            .await
            .map_err(|e| err("reading the stream")(e.to_string()))?;
        let c: consumer::PullConsumer = s
            .create_consumer(consumer::pull::Config {
                durable_name: Some("raw".into()),
                ack_policy: consumer::AckPolicy::Explicit,
                ack_wait: Duration::from_secs(30),
                ..Default::default()
            })
            .await
            .map_err(|e| err("creating the raw consumer")(e.to_string()))?;
        let started = Instant::now();
        let messages = c
            .stream()
            .max_messages_per_batch(a.concurrency.max(1) * 4)
            .messages()
            .await
            .map_err(|e| err("pulling")(e.to_string()))?;
        let acked = std::sync::atomic::AtomicUsize::new(0);
        let failed = std::sync::Mutex::new(None::<String>);
        messages
            .take(a.broker_messages)
            .for_each_concurrent(a.concurrency, |m| {
                let (acked, failed) = (&acked, &failed);
                async move {
                    let r = match m {
                        Ok(m) => m.double_ack().await.map_err(|e| e.to_string()),
                        Err(e) => Err(e.to_string()),
                    };
                    match r {
                        Ok(()) => {
                            acked.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        Err(e) => *failed.lock().expect("poisoned") = Some(e),
                    }
                }
            })
            .await;
        let secs = started.elapsed().as_secs_f64();
        if let Some(e) = failed.into_inner().expect("poisoned") {
            return Err(err("the raw consume")(e));
        }
        Ok(secs)
    }
}

#[cfg(feature = "redis")]
mod redis_shape {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use futures::SinkExt;
    use redis::aio::MultiplexedConnection;
    use redis::streams::StreamReadReply;
    use txoutbox_redis_broker::{RedisSubscription, RedisSubscriptionConfig};

    use super::*;

    fn err(what: &'static str) -> impl Fn(redis::RedisError) -> BenchError {
        move |e| BenchError(format!("Redis: {what} failed: {e}"))
    }

    pub async fn measure(a: &InboxArgs, lib_first: bool) -> Result<Measured, BenchError> {
        let url = &a.conn.redis_url;
        let mut c = redis::Client::open(url.as_str())
            .map_err(err("parsing REDIS_URL"))?
            .get_multiplexed_async_connection()
            .await
            .map_err(|e| BenchError(format!("Redis at {url} is unreachable: {e}")))?;
        let prefix = format!("ibench:{}:", crate::inbox::run_tag("r"));
        let key = format!("{prefix}{SOURCE}");
        let bed = Bed::create(&a.conn, 2).await;
        let res = async {
            let bed = bed.as_ref().map_err(|e| BenchError(e.0.clone()))?;
            publish(&mut c, &key, a).await?;
            let lib = async {
                let sub = RedisSubscription::connect(
                    RedisSubscriptionConfig::new(url.clone(), "g", "bench", [SOURCE])
                        .key_prefix(&prefix),
                )
                .await
                .map_err(|e| BenchError(format!("Redis: the subscription: {e}")))?;
                library(bed, a, Arc::new(sub)).await
            };
            let (lib_s, ref_s) = both(lib_first, lib, raw(&c, &key, a)).await?;
            let scripted = scripted_rate(a, a.broker_messages).await?;
            Ok(measured(a, lib_s, ref_s, scripted, "redis"))
        }
        .await;
        if let Ok(b) = bed {
            b.drop().await;
        }
        let _: Result<i64, _> = redis::cmd("DEL").arg(&key).query_async(&mut c).await;
        res
    }

    async fn publish(
        c: &mut MultiplexedConnection,
        key: &str,
        a: &InboxArgs,
    ) -> Result<(), BenchError> {
        for chunk in (0..a.broker_messages).collect::<Vec<_>>().chunks(1000) {
            let mut p = redis::pipe();
            for &i in chunk {
                let (id, k) = attrs(i, a.keys);
                p.cmd("XADD")
                    .arg(key)
                    .arg("*")
                    .arg("event_id")
                    .arg(id)
                    .arg("topic")
                    .arg(SOURCE)
                    .arg("event_type")
                    .arg("bench")
                    .arg("partition_key")
                    .arg(k)
                    .arg("payload")
                    .arg(body(i))
                    .ignore();
            }
            let () = p.query_async(c).await.map_err(err("XADD"))?;
        }
        Ok(())
    }

    /// The raw consume: a group of its own read by XREADGROUP COUNT 64, one XACK per entry, C
    /// in flight beside the reads.
    async fn raw(c: &MultiplexedConnection, key: &str, a: &InboxArgs) -> Result<f64, BenchError> {
        let mut c = c.clone();
        let () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(key)
            .arg("raw")
            .arg("0")
            .query_async(&mut c)
            .await
            .map_err(err("XGROUP CREATE"))?;
        let started = Instant::now();
        let n = a.broker_messages;
        let (mut tx, rx) = futures::channel::mpsc::channel::<String>(a.concurrency * 8);
        let mut rc = c.clone();
        let key_r = key.to_owned();
        let reader = async move {
            let mut read = 0usize;
            while read < n {
                let reply: Option<StreamReadReply> = redis::cmd("XREADGROUP")
                    .arg("GROUP")
                    .arg("raw")
                    .arg("c1")
                    .arg("COUNT")
                    .arg(64)
                    .arg("BLOCK")
                    .arg(100)
                    .arg("STREAMS")
                    .arg(&key_r)
                    .arg(">")
                    .query_async(&mut rc)
                    .await
                    .map_err(err("XREADGROUP"))?;
                for k in reply.map(|r| r.keys).unwrap_or_default() {
                    for e in k.ids {
                        read += 1;
                        if tx.send(e.id).await.is_err() {
                            return Err(BenchError("the ack tasks ended early".into()));
                        }
                    }
                }
            }
            Ok::<(), BenchError>(())
        };
        let acked = AtomicUsize::new(0);
        let failed = std::sync::Mutex::new(None::<redis::RedisError>);
        let ackers = rx.for_each_concurrent(a.concurrency, |id| {
            let mut c = c.clone();
            let (acked, failed) = (&acked, &failed);
            async move {
                let r: Result<i64, _> = redis::cmd("XACK")
                    .arg(key)
                    .arg("raw")
                    .arg(&id)
                    .query_async(&mut c)
                    .await;
                match r {
                    Ok(_) => {
                        acked.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => *failed.lock().expect("poisoned") = Some(e),
                }
            }
        });
        let (read, ()) = futures::join!(reader, ackers);
        read?;
        let secs = started.elapsed().as_secs_f64();
        if let Some(e) = failed.into_inner().expect("poisoned") {
            return Err(err("XACK")(e));
        }
        if acked.load(Ordering::SeqCst) != n {
            return Err(BenchError(format!(
                "Redis: the raw consume acked {} of {n}",
                acked.load(Ordering::SeqCst)
            )));
        }
        Ok(secs)
    }
}
