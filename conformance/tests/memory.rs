//! The conformance suite against the in-memory reference backend.

txoutbox_conformance::suite!(memory: txoutbox_conformance::memory::MemFactory);

/// The whole suite again with every relay in delivery mode `transaction` (R84); trial names
/// start with `transaction::`.
mod transaction {
    txoutbox_conformance::suite!(memory_transaction: txoutbox_conformance::InTransaction(
        txoutbox_conformance::memory::MemFactory
    ));
}
