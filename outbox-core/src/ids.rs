//! Event ids: UUIDv7 from a monotonic generator (R14).

use std::sync::Mutex;

use uuid::Uuid;

static LAST: Mutex<u128> = Mutex::new(0);

/// A new UUIDv7, strictly greater than every id this process made before.
///
/// `Uuid::now_v7` already orders ids within a millisecond by a counter; the guard below also
/// covers a system clock that steps back, by bumping the previous value.
pub fn new_event_id() -> Uuid {
    let candidate = Uuid::now_v7().as_u128();
    let mut last = LAST.lock().expect("id generator poisoned");
    let next = if candidate > *last {
        candidate
    } else {
        bump_v7(*last)
    };
    *last = next;
    Uuid::from_u128(next)
}

/// Increments the 62 random bits of a v7 id (keeping version and variant bits), carrying into
/// rand_a and the timestamp if needed.
fn bump_v7(v: u128) -> u128 {
    let mut b = Uuid::from_u128(v).into_bytes();
    // Bytes 8..16 hold the variant (top 2 bits of byte 8) and 62 random bits.
    let low = u64::from_be_bytes(b[8..16].try_into().expect("8 bytes")) & 0x3FFF_FFFF_FFFF_FFFF;
    if low < 0x3FFF_FFFF_FFFF_FFFF {
        let n = (low + 1) | 0x8000_0000_0000_0000;
        b[8..16].copy_from_slice(&n.to_be_bytes());
        return u128::from_be_bytes(b);
    }
    // Overflow of the random part: bump the timestamp by one millisecond instead.
    let ms = (v >> 80) + 1;
    (ms << 80) | (0x7u128 << 76) | (0x2u128 << 62)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_v7_and_strictly_increasing() {
        let mut prev = new_event_id();
        assert_eq!(prev.get_version_num(), 7);
        for _ in 0..20_000 {
            let next = new_event_id();
            assert!(next > prev, "{next} not after {prev}");
            assert_eq!(next.get_version_num(), 7);
            prev = next;
        }
    }

    #[test]
    fn bump_keeps_version_and_order() {
        let v = Uuid::now_v7().as_u128();
        let b = Uuid::from_u128(bump_v7(v));
        assert!(b.as_u128() > v);
        assert_eq!(b.get_version_num(), 7);
        assert_eq!(b.get_variant(), uuid::Variant::RFC4122);
    }
}
