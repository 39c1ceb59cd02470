#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

pub mod amqp_proxy;
pub mod broker;
pub mod ctx;
pub mod harness;
pub mod inbox;
pub mod kafka;
pub mod kafka_proxy;
pub mod memory;
pub mod net;
pub mod rabbitmq;
pub mod scenarios;

pub use harness::{BackendKind, Factory, Harness, InTransaction, RowPatch, WriteTx};

/// Generates one `#[tokio::test]` per scenario, named after its ID (`o_01` is O-01).
///
/// `suite!(memory: FACTORY)` runs the `[all]` and `[mem]` scenarios; `suite!(postgres: FACTORY)` the
/// `[all]` and `[pg]` ones; `suite!(other: FACTORY)` the `[all]` ones. FACTORY is an expression
/// evaluated per test whose value implements [`Factory`].
///
/// `suite!(postgres_partitioned: FACTORY)` is for a Postgres harness whose table has the
/// partitioned layout: the `[all]` and `[pg]` scenarios except PG-02 (the table equals Appendix A's,
/// which a partitioned table cannot: its primary key holds created_at and its idempotency-key
/// index is not unique) and PG-10 (schema creation over an existing plain ancestor table,
/// which the partitioned layout refuses instead of converting). The backend's own tests cover
/// the partitioned form of both.
///
/// Delivery in one transaction (R84): `suite!(memory_transaction: InTransaction(FACTORY))`,
/// `suite!(postgres_transaction: InTransaction(FACTORY))` and
/// `suite!(postgres_partitioned_transaction: InTransaction(FACTORY))` run every relay of the
/// suite in that mode ([`InTransaction`]): the scenarios that hold in both modes, then the TX
/// group (TX-02's commit and rollback variants and TX-04 on every backend, the rest with SQL),
/// and none of the lease-mode-only scenarios (the lease stamp, a transient failure's write).
#[macro_export]
macro_rules! suite {
    (memory: $f:expr) => {
        $crate::suite!(@all $f);
        $crate::suite!(@paused $f; outage::t_11, lease::l_09, lease::l_13);
        $crate::suite!(@tests $f; lease::l_10, lease::l_15, maint::c_04);
    };
    (postgres: $f:expr) => {
        $crate::suite!(@all $f);
        $crate::suite!(@tests $f; pg::pg_01, pg::pg_02, pg::pg_03, pg::pg_04, pg::pg_05,
            pg::pg_06, pg::pg_07, pg::pg_08, pg::pg_09, pg::pg_10, pg::pg_11, pg::pg_12,
            pg::p_08, park::op_12);
    };
    (postgres_partitioned: $f:expr) => {
        $crate::suite!(@all $f);
        $crate::suite!(@tests $f; pg::pg_01, pg::pg_03, pg::pg_04, pg::pg_05, pg::pg_06,
            pg::pg_07, pg::pg_08, pg::pg_09, pg::pg_11, pg::pg_12, pg::p_08, park::op_12);
    };
    (memory_transaction: $f:expr) => {
        $crate::suite!(@both $f);
        $crate::suite!(@paused $f; outage::t_11, lease::l_09);
        $crate::suite!(@tests $f; tx::tx_02_commit, tx::tx_02_rollback, tx::tx_04);
    };
    (postgres_transaction: $f:expr) => {
        $crate::suite!(@both $f);
        $crate::suite!(@tests $f; pg::pg_01, pg::pg_02, pg::pg_03, pg::pg_04, pg::pg_05,
            pg::pg_06, pg::pg_07, pg::pg_09, pg::pg_10, pg::pg_11, pg::pg_12, pg::p_08, park::op_12,
            tx::tx_01, tx::tx_02, tx::tx_02_commit, tx::tx_02_rollback, tx::tx_03, tx::tx_04, tx::tx_05);
    };
    (postgres_partitioned_transaction: $f:expr) => {
        $crate::suite!(@both $f);
        $crate::suite!(@tests $f; pg::pg_01, pg::pg_03, pg::pg_04, pg::pg_05, pg::pg_06,
            pg::pg_07, pg::pg_09, pg::pg_11, pg::pg_12, pg::p_08, park::op_12,
            tx::tx_01, tx::tx_02, tx::tx_02_commit, tx::tx_02_rollback, tx::tx_03, tx::tx_04, tx::tx_05);
    };
    (other: $f:expr) => {
        $crate::suite!(@all $f);
    };
    (@all $f:expr) => {
        $crate::suite!(@both $f);
        $crate::suite!(@lease_only $f);
    };
    // The scenarios that hold in both delivery modes.
    (@both $f:expr) => {
        $crate::suite!(@tests $f;
            order::o_01, order::o_02, order::o_03, order::o_04, order::o_05, order::o_07,
            order::o_08, order::o_09, order::o_10, order::o_11, order::o_12, order::o_13,
            order::o_14, order::o_16, order::o_18, order::o_19, writing::w_01, writing::w_02,
            writing::w_03, writing::w_04, writing::w_05, writing::i_01, writing::i_02,
            writing::i_03, writing::i_04, validation::v_01_to_v_12, validation::v_13,
            validation::v_14, validation::v_14_stored, validation::v_16, validation::v_17,
            backoff::b_01, backoff::b_02, backoff::b_03, backoff::b_04, backoff::b_05,
            backoff::b_06, backoff::b_07, backoff::b_10, backoff::b_12, backoff::b_13,
            backoff::b_14, backoff::h_01, backoff::h_05, backoff::h_06, backoff::h_08,
            backoff::h_10, backoff::h_11, backoff::h_12, backoff::h_13, outage::t_03, outage::t_08,
            lease::l_01, lease::l_02, lease::l_03, lease::l_04, lease::l_05, lease::l_06,
            lease::l_07, lease::l_08, maint::r_01, maint::r_02, maint::c_01, maint::c_02,
            runs::q_01, runs::q_02, runs::q_06, runs::q_07, runs::q_08, runs::q_09, runs::x_01,
            runs::x_03, runs::x_04, runs::x_05, pipeline::p_02, pipeline::p_03, pipeline::p_07, pipeline::m_01,
            pipeline::m_02, pipeline::m_03, stand::s_01, stand::s_02,
            writing::w_06, validation::v_18, validation::v_19, order::o_20, order::o_21,
            maint::c_03, pipeline::p_09, pipeline::p_10, backoff::h_15, order::o_22,
            order::o_23, runs::q_11, lease::l_16, pipeline::m_04,
            park::op_01, park::op_02, park::op_03, park::op_04, park::op_05, park::op_07
        );
    };
    // The scenarios about what the lease mode writes: a transient failure's last_error and
    // +1 s retry (R43, R47), the lease stamp (R21) and a failed commit leaving rows leased.
    // Delivery in one transaction writes none of these (R84); TX-01 to TX-05 cover its side.
    (@lease_only $f:expr) => {
        $crate::suite!(@tests $f;
            backoff::b_08, backoff::h_09, backoff::h_14, order::o_06, order::o_17, pipeline::p_06,
            runs::q_03, runs::q_04, runs::q_05, outage::t_01, outage::t_02, outage::t_04,
            outage::t_05, outage::t_06, outage::t_07, outage::t_10, runs::x_02, lease::l_11,
            lease::l_12, lease::l_14, runs::q_10
        );
    };
    (@tests $f:expr; $($m:ident :: $name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                $crate::scenarios::$m::$name(&$f).await;
            }
        )*
    };
    (@paused $f:expr; $($m:ident :: $name:ident),* $(,)?) => {
        $(
            #[tokio::test(start_paused = true)]
            async fn $name() {
                $crate::scenarios::$m::$name(&$f).await;
            }
        )*
    };
}

/// Generates one `#[tokio::test]` per inbox scenario, named after its ID (`n_14` is N-14).
///
/// `inbox_suite!(memory: FACTORY)` runs the `[all]` and `[mem]` scenarios of the inbox; FACTORY
/// is an expression evaluated per test whose value implements [`inbox::InboxFactory`].
/// `inbox_suite!(postgres: FACTORY)` and `inbox_suite!(postgres_partitioned: FACTORY)` run the
/// `[all]` ones on a Postgres store, plain or partitioned, and the `[pg]` ones written so far
/// (F-13, F-21, Y-03, Y-16, Y-23, Z-04 and E-18 on both; D-03 to D-06 and P-04, which need siblings, on the
/// partitioned table; E-14 with `postgres_past_partition`, a partitioned table with one past
/// partition only).
#[macro_export]
macro_rules! inbox_suite {
    (postgres: $f:expr) => {
        $crate::inbox_suite!(@all $f);
        $crate::inbox_suite!(@tests $f; pg::f_13, pg::f_21, pg::y_03, pg::y_16, pg::y_23, pg::z_04,
            pg::e_18, batches::bt_03, batches::bt_12);
    };
    (postgres_partitioned: $f:expr) => {
        $crate::inbox_suite!(@all $f);
        $crate::inbox_suite!(@tests $f; pg::f_13, pg::f_21, pg::y_03, pg::y_16, pg::y_23, pg::z_04, pg::d_03,
            pg::d_04, pg::d_05, pg::p_04, pg::d_06, pg::e_18, batches::bt_03, batches::bt_12);
    };
    // A partitioned table with one partition for a past month only: E-14.
    (postgres_past_partition: $f:expr) => {
        $crate::inbox_suite!(@tests $f; pg::e_14);
    };
    (memory: $f:expr) => {
        $crate::inbox_suite!(@all $f);
        $crate::inbox_suite!(@paused $f; paced::n_19, paced::f_20, paced::f_23, paced::f_26, paced::y_10, paced::y_20,
            paced::y_19);
    };
    (@all $f:expr) => {
        $crate::inbox_suite!(@tests $f;
            policies::n_01, policies::n_02, policies::n_03, policies::n_04, policies::n_05,
            policies::n_06, policies::n_07, policies::n_08, policies::n_09, policies::n_10,
            policies::n_11, policies::n_12, policies::n_13, policies::n_14, policies::n_15,
            policies::n_16, policies::n_17, policies::n_18,
            failures::f_01, failures::f_02, failures::f_03, failures::f_04, failures::f_05,
            failures::f_06, failures::f_07, failures::f_08, failures::f_09, failures::f_10,
            failures::f_11, failures::f_12, failures::f_14, failures::f_15, failures::f_16,
            failures::f_17, failures::f_18, failures::f_19, failures::f_22, failures::f_24,
            failures::f_25, failures::f_27,
            processor::p_01, processor::b_09, processor::b_11, processor::t_09, processor::h_02,
            processor::h_03, processor::h_04, processor::h_07, processor::y_01, processor::y_02,
            processor::y_04, processor::y_05, processor::y_06, processor::y_07, processor::y_08,
            processor::y_09, processor::y_11, processor::y_12, processor::y_13, processor::y_14,
            processor::y_15, processor::y_17, processor::y_18, processor::y_21, processor::y_22,
            groups::g_01, groups::g_02, groups::g_03, groups::g_04, groups::g_05, groups::g_06,
            groups::g_07, groups::g_08, groups::g_09,
            dedup::i_06, dedup::d_01, dedup::d_02, dedup::d_07, dedup::d_08,
            decoding::e_01, decoding::e_02, decoding::e_03, decoding::e_04, decoding::e_05,
            decoding::e_06, decoding::e_07, decoding::e_08, decoding::e_09, decoding::e_10,
            decoding::e_11, decoding::e_12, decoding::e_13, decoding::e_15, decoding::e_16, decoding::e_17,
            visibility::a_01, visibility::a_02, visibility::a_05, stand::si_01, stand::si_02,
            park::op_06, processor_batches::bt_11, processor_batches::bt_11_commit,
            batches::bt_01, batches::bt_02, batches::bt_04, batches::bt_05, batches::bt_06,
            batches::bt_07, batches::bt_08, batches::bt_09, batches::bt_10, batches::bt_14,
            batches::bt_15
        );
        $crate::inbox_suite!(@one_row $f;
            processor::p_01, processor::b_09, processor::b_11, processor::t_09, processor::h_02,
            processor::h_03, processor::h_04, processor::h_07, processor::y_01, processor::y_02,
            processor::y_04, processor::y_05, processor::y_06, processor::y_07, processor::y_08,
            processor::y_09, processor::y_11, processor::y_12, processor::y_13, processor::y_14,
            processor::y_15, processor::y_17, processor::y_18, processor::y_21, processor::y_22,
            groups::g_05, groups::g_06, groups::g_07
        );
    };
    // The processor scenarios again with one row per transaction (R183: Part II word for
    // word), in a module of their own.
    (@one_row $f:expr; $($m:ident :: $name:ident),* $(,)?) => {
        mod one_row_per_transaction {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    $crate::inbox::ctx::ROWS_PER_TRANSACTION
                        .scope(1, $crate::inbox::scenarios::$m::$name(&$f))
                        .await;
                }
            )*
        }
    };
    (@tests $f:expr; $($m:ident :: $name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                $crate::inbox::scenarios::$m::$name(&$f).await;
            }
        )*
    };
    (@paused $f:expr; $($m:ident :: $name:ident),* $(,)?) => {
        $(
            #[tokio::test(start_paused = true)]
            async fn $name() {
                $crate::inbox::scenarios::$m::$name(&$f).await;
            }
        )*
    };
}
