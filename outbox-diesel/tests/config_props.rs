//! Issue 14: the diesel backend's configuration and pool settings take any value without
//! panicking: a clear error or a setting, never a crash. No database needed.

use std::time::Duration;

use proptest::prelude::*;
use txoutbox_core::repository::MAX_BACKEND_BATCH_SIZE;
use txoutbox_diesel::{DieselConfig, PoolSettings, build_pool};

fn any_duration() -> impl Strategy<Value = Duration> {
    prop_oneof![
        Just(Duration::ZERO),
        Just(Duration::MAX),
        (any::<u64>(), 0u32..1_000_000_000).prop_map(|(s, n)| Duration::new(s, n)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn config_and_pool_builders_take_any_value(
        name in prop_oneof![Just("outbox_events".to_owned()), Just("s.t".to_owned()), any::<String>()],
        batch in prop_oneof![Just(0usize), Just(usize::MAX), any::<usize>(), 0usize..20_000],
        error_max in prop_oneof![Just(0usize), Just(usize::MAX), any::<usize>(), 0usize..100],
        size in prop_oneof![Just(0usize), Just(usize::MAX), any::<usize>(), 0usize..64],
        wait in any_duration(),
        create in any_duration(),
        url in prop_oneof![Just("postgres://postgres@127.0.0.1:5432/test".to_owned()), any::<String>()],
    ) {
        match DieselConfig::default().table_name(&name) {
            Ok(c) => prop_assert!(!c.table_ref().qualified().is_empty()),
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
        match DieselConfig::default().batch_size(batch) {
            Ok(_) => prop_assert!((1..=MAX_BACKEND_BATCH_SIZE).contains(&batch)),
            Err(e) => prop_assert!(e.to_string().contains("batch_size")),
        }
        let _ = DieselConfig::default().error_max_length(error_max);
        let settings = match PoolSettings::default().max_size(size) {
            Ok(s) => s,
            Err(e) => {
                prop_assert!(e.to_string().contains("max_size"));
                PoolSettings::default()
            }
        }
        .wait_timeout(wait)
        .create_timeout(create);
        // Building opens nothing; it must not panic whatever the URL and timeouts.
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let _ = build_pool(&url, &settings);
        });
    }
}
