//! Issue 14: the sqlx backend's configuration takes any value without panicking: a clear error
//! or a setting, never a crash. No database needed.

use std::time::Duration;

use proptest::prelude::*;
use txoutbox_core::WorkerId;
use txoutbox_core::repository::{FetchRequest, MAX_BACKEND_BATCH_SIZE};
use txoutbox_postgres::sql::FetchParams;
use txoutbox_postgres::{PgConfig, TableName};

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn config_builders_take_any_value(
        name in prop_oneof![Just("outbox_events".to_owned()), Just("s.t".to_owned()), any::<String>()],
        batch in prop_oneof![Just(0usize), Just(usize::MAX), any::<usize>(), 0usize..20_000],
        error_max in prop_oneof![Just(0usize), Just(usize::MAX), any::<usize>(), 0usize..100],
        limit in any::<usize>(),
        per_key in any::<usize>(),
        lease in (any::<u64>(), 0u32..1_000_000_000).prop_map(|(s, n)| Duration::new(s, n)),
    ) {
        let _ = TableName::new(&name);
        match PgConfig::default().table_name(&name) {
            Ok(c) => prop_assert!(!c.table_ref().qualified().is_empty()),
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
        match PgConfig::default().batch_size(batch) {
            Ok(_) => prop_assert!((1..=MAX_BACKEND_BATCH_SIZE).contains(&batch)),
            Err(e) => prop_assert!(e.to_string().contains("batch_size")),
        }
        let _ = PgConfig::default().error_max_length(error_max);
        // The fetch's binds from any request the repository validates first.
        let req = FetchRequest::new(WorkerId::new("w1").unwrap(), limit)
            .max_per_key(per_key)
            .lease_ttl(lease);
        if req.validate().is_ok() {
            let p = FetchParams::new(&req);
            prop_assert!(p.limit >= 1 && p.lease_us >= 0 && p.max_per_key >= 1);
        }
    }
}
