#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

pub mod broker;
pub mod ctx;
pub mod harness;
pub mod memory;
pub mod scenarios;

pub use harness::{BackendKind, Factory, Harness, RowPatch, WriteTx};

/// Generates one `#[tokio::test]` per scenario, named after its ID (`o_01` is O-01).
///
/// `suite!(memory: FACTORY)` runs the [all] and [mem] scenarios; `suite!(postgres: FACTORY)` the
/// [all] and [pg] ones; `suite!(other: FACTORY)` the [all] ones. FACTORY is an expression
/// evaluated per test whose value implements [`Factory`].
#[macro_export]
macro_rules! suite {
    (memory: $f:expr) => {
        $crate::suite!(@all $f);
        // PAUSED-LIST
    };
    (postgres: $f:expr) => {
        $crate::suite!(@all $f);
        // PG-LIST
    };
    (other: $f:expr) => {
        $crate::suite!(@all $f);
    };
    (@all $f:expr) => {
        $crate::suite!(@tests $f;
            order::o_01, order::o_02, order::o_03, order::o_04, order::o_05, order::o_06,
            order::o_07, order::o_08, order::o_09, order::o_10, order::o_11, order::o_12,
            order::o_13, order::o_14, order::o_16, order::o_17, order::o_18, order::o_19,
            writing::w_01, writing::w_02, writing::w_03, writing::w_04, writing::w_05,
            writing::i_01, writing::i_02, writing::i_03, writing::i_04,
            validation::v_01_to_v_12, validation::v_13, validation::v_14, validation::v_14_stored,
            validation::v_16, validation::v_17
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
