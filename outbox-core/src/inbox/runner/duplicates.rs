//! The runner's duplicate probe (issue 21's `duplicates` benchmark): when recent deliveries were
//! mostly duplicates, one autocommit read of the dedup key's row before T answers a redelivery
//! of a completed or failed message without opening T.
//!
//! Why the contract allows it: R109 and R130 make a delivery whose dedup key's row is
//! `completed` or `failed` a `duplicate` under every policy, without a handler run or a write.
//! The read returns the row R111 and R112 name (`get_by_message_id`), the one T's landing would
//! find. A `completed` row is terminal (only cleanup removes it, R163) and a `failed` one
//! changes only by an operator's requeue (R162), so the answer read in autocommit is the one T
//! would give if it ran at the moment of the read, a moment inside the delivery's handling: the
//! key lock (R116 step 1) and the row lock (step 3) only order T after transactions that are
//! still open, and a row committed as completed or failed has none left that could change that
//! answer (R152's T_row commits its outcome before the row reads as completed). A row that is
//! pending, missing or unreadable (R106) takes T as before, so the probe changes no outcome.
//!
//! The probe costs one round trip when it misses and saves T's when it hits (begin, the key
//! lock, the landing, the row read and lock, commit), so the runner takes it only while
//! duplicates are likely: an exponentially weighted share of the deliveries that ended in T or
//! in the probe, at least [`PROBE_AT`].

use std::sync::atomic::{AtomicU32, Ordering};

/// Fixed-point unit of the share (1.0).
const ONE: u32 = 1 << 16;
/// The weight of the latest delivery in the share (1/16).
const WEIGHT_SHIFT: u32 = 4;
/// The share of duplicates from which the probe pays: a miss costs one round trip, a hit saves
/// about five, so from about one in six.
pub const PROBE_AT: u32 = ONE / 6;

/// The share of recent deliveries that were duplicates, in units of 1/65,536 (`ONE` is the whole).
#[derive(Debug, Default)]
pub struct DuplicateShare(AtomicU32);

impl DuplicateShare {
    /// Whether the probe pays now.
    pub fn likely(&self) -> bool {
        self.0.load(Ordering::Relaxed) >= PROBE_AT
    }

    /// Counts one delivery that ended in T or in the probe.
    pub fn record(&self, duplicate: bool) {
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                let add = if duplicate { ONE >> WEIGHT_SHIFT } else { 0 };
                Some(v - (v >> WEIGHT_SHIFT) + add)
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_starts_after_a_few_duplicates_and_stops_after_new_messages() {
        let s = DuplicateShare::default();
        assert!(!s.likely(), "no probe before any duplicate");
        s.record(true);
        assert!(!s.likely(), "one duplicate is not a trend");
        for _ in 0..3 {
            s.record(true);
        }
        assert!(s.likely(), "four duplicates in a row start the probe");
        for _ in 0..200 {
            s.record(true);
        }
        assert!(s.likely());
        let mut misses = 0;
        while s.likely() {
            s.record(false);
            misses += 1;
        }
        assert!(
            (20..=40).contains(&misses),
            "about 28 new messages stop it, got {misses}"
        );
    }

    #[test]
    fn new_messages_alone_never_probe() {
        let s = DuplicateShare::default();
        for _ in 0..1000 {
            s.record(false);
            assert!(!s.likely());
        }
    }
}
