//! The inbox scenarios on the diesel-async store, plain table (contract Part II). Run with
//! `-- --test-threads 4`.

use txoutbox_testkit::diesel as common;

txoutbox_conformance::inbox_suite!(postgres: common::inbox::DieselInboxFactory::plain());
