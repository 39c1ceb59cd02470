//! The core ordering, head-run and backoff scenarios on a table created with the ancestor's DDL
//! exactly as the ancestor library created it (R78), without the additions: the library needs
//! nothing beyond it to be correct (the additions make its plans independent of statistics).

use txoutbox_testkit::PgFactory;

txoutbox_conformance::suite!(@tests PgFactory::new().ancestor_ddl();
    order::o_01, order::o_02, order::o_03, order::o_04, order::o_05, order::o_06, order::o_07,
    order::o_08, order::o_09, order::o_10, order::o_11, order::o_12, order::o_13, order::o_14,
    order::o_16, order::o_19,
    runs::q_01, runs::q_02, runs::q_05, runs::q_06, runs::q_07, runs::q_08,
    backoff::b_01, backoff::b_02, backoff::b_03, backoff::b_04, backoff::b_06, backoff::b_07,
    backoff::b_08, backoff::b_10, backoff::b_14);
