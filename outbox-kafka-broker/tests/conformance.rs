//! Kafka trials K-07, K-09 to K-11 and K-14 to K-18 against the broker at `KAFKA_BROKERS`
//! (default `127.0.0.1:9092`: the Tansu broker `.ci/run` starts; point it at a real Kafka to
//! run the cases Tansu's capabilities gate). Each trial uses fresh topics and deletes them at
//! the end; an unreachable broker fails the trials. A case gated by a capability the broker does
//! not declare prints `SKIPPED … needs <capability>`.

mod common;

use common::*;

txoutbox_conformance::kafka_suite!(TestKafka);
