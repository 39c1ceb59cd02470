//! The conformance suite against the in-memory reference backend.

outbox_conformance::suite!(memory: outbox_conformance::memory::MemFactory);

/// The whole suite again with every relay in delivery mode `transaction` (R84); trial names
/// start with `transaction::`.
mod transaction {
    outbox_conformance::suite!(memory_transaction: outbox_conformance::InTransaction(
        outbox_conformance::memory::MemFactory
    ));
}
