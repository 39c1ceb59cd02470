//! The conformance suite against the in-memory reference backend.

outbox_conformance::suite!(memory: outbox_conformance::memory::MemFactory);
