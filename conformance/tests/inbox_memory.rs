//! The inbox scenarios against the in-memory reference inbox.

outbox_conformance::inbox_suite!(memory: outbox_conformance::inbox::memory::MemInboxFactory);
