//! The inbox scenarios against the in-memory reference inbox.

txoutbox_conformance::inbox_suite!(memory: txoutbox_conformance::inbox::memory::MemInboxFactory);
