//! The host side of the device page checks.
//!
//! A sequence's block table crosses to the device as one `u64` per page,
//! `(generation << 32) | page`: the generation the sequence was granted the
//! page at, in the entry the kernel loads anyway, so the check costs one
//! more 4-byte load per page (the page's generation on the device) and
//! none per key. Generations are 64-bit on the host; the device compares
//! their low 32 bits, so a stale entry passes only if its page was
//! allocated and released exactly 2^31 times since (an allocation and a
//! release each bump it once) while the entry stayed in use.
//!
//! The kernels record the first failure of each chunk in a [`Violation`]
//! (32 bytes); the host copies the records back with the step's outputs and
//! turns each into the error the CPU pool would have raised.

use kvmesh_kernels::paged::{GuardViolation, PageRef};

/// Pack a page-table entry for the device.
pub fn pack(entry: PageRef) -> u64 {
    ((entry.generation & 0xffff_ffff) << 32) | u64::from(entry.page)
}

/// The `(page, generation)` of a packed entry.
pub fn unpack(e: u64) -> (u32, u32) {
    (e as u32, (e >> 32) as u32)
}

/// What a kernel found wrong (the `kind` field of a record).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum ViolationKind {
    /// The entry names a page past the pool.
    PageOutOfRange = 1,
    /// The page's generation is not the entry's: released since.
    StaleGeneration = 2,
    /// The layer's watermark is below the slots the read needs.
    Unwritten = 3,
    /// The table has no entry for a position read or written.
    TableTooShort = 4,
    /// A write would start above the layer's watermark.
    WriteGap = 5,
    /// A write at a position of the sequence's shared head (pages leased
    /// from the prefix cache, read-only). Set by the host before the step
    /// ([`Violation::shared_page`]), so the chunk writes nothing.
    SharedPage = 6,
}

/// One chunk's record, as the kernels write it (`struct Violation` in
/// `common.cuh`: eight `u32`s).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct Violation {
    /// 0 (none) or a [`ViolationKind`].
    pub kind: u32,
    /// The page named by the entry (or the table index, for a short table).
    pub page: u32,
    /// The layer.
    pub layer: u32,
    /// The table's generation, the slots requested, or (short table) the
    /// entries needed.
    pub expected: u32,
    /// The device's generation, the watermark, or the table's length.
    pub actual: u32,
    /// The position being read or written.
    pub position: u32,
    /// Padding to 32 bytes.
    pub pad: [u32; 2],
}

/// A record decoded: nothing, a read refused (I1, I2: the CPU pool's
/// [`GuardViolation`]), or a write refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decoded {
    /// No failure.
    Clean,
    /// A read or write of a page the sequence does not hold, or of slots
    /// never written.
    Guard(GuardViolation),
    /// A write that would leave unwritten slots below it.
    WriteGap {
        /// The page.
        page: u32,
        /// The layer.
        layer: usize,
        /// The slot the write started at.
        slot: usize,
        /// The watermark.
        watermark: usize,
    },
    /// A write at a position of the sequence's cached head, which other
    /// sequences share: the CPU pool's `PoolError::SharedPage`.
    SharedPage {
        /// The first position the write would fill.
        position: usize,
        /// Tokens of the cached head.
        cached: usize,
    },
    /// A kind no kernel writes: device memory was corrupted or a kernel
    /// and this host code disagree. Fails the sequence like a violation.
    Unknown {
        /// The raw record.
        raw: Violation,
    },
}

impl Violation {
    /// What the record says.
    pub fn decode(&self, n_pages: u32) -> Decoded {
        let page = self.page;
        match self.kind {
            0 => Decoded::Clean,
            1 => Decoded::Guard(GuardViolation::PageOutOfRange { page, n_pages }),
            2 => Decoded::Guard(GuardViolation::StaleGeneration {
                page,
                expected: u64::from(self.expected),
                actual: u64::from(self.actual),
            }),
            3 => Decoded::Guard(GuardViolation::Unwritten {
                page,
                layer: self.layer as usize,
                requested: self.expected as usize,
                watermark: self.actual as usize,
            }),
            4 => Decoded::Guard(GuardViolation::TableTooShort {
                position: self.position as usize,
                needed: page as usize,
                len: self.actual as usize,
            }),
            5 => Decoded::WriteGap {
                page,
                layer: self.layer as usize,
                slot: self.expected as usize,
                watermark: self.actual as usize,
            },
            6 => Decoded::SharedPage {
                position: self.position as usize,
                cached: self.expected as usize,
            },
            _ => Decoded::Unknown { raw: *self },
        }
    }

    /// The record of a chunk that would write position `position` of a
    /// sequence whose first `cached` positions are shared (leased) pages.
    pub fn shared_page(position: u32, cached: u32) -> Self {
        Self {
            kind: ViolationKind::SharedPage as u32,
            page: 0,
            layer: 0,
            expected: cached,
            actual: 0,
            position,
            pad: [0; 2],
        }
    }

    /// The record as the `u32`s the device holds.
    pub fn to_words(self) -> [u32; 8] {
        [
            self.kind,
            self.page,
            self.layer,
            self.expected,
            self.actual,
            self.position,
            self.pad[0],
            self.pad[1],
        ]
    }

    /// A record from the `u32`s the device wrote.
    pub fn from_words(w: &[u32]) -> Self {
        let g = |i: usize| w.get(i).copied().unwrap_or(0);
        Self {
            kind: g(0),
            page: g(1),
            layer: g(2),
            expected: g(3),
            actual: g(4),
            position: g(5),
            pad: [g(6), g(7)],
        }
    }
}

/// Every chunk's table, packed back to back, with each chunk's offset and
/// length: what the kernels index with `toff[c]` and `tlen[c]`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PackedTables {
    /// The entries.
    pub entries: Vec<u64>,
    /// Offset of each chunk's first entry.
    pub offsets: Vec<u32>,
    /// Entries of each chunk.
    pub lens: Vec<u32>,
}

impl PackedTables {
    /// Pack the chunks' tables, in order.
    pub fn new<'a>(tables: impl IntoIterator<Item = &'a [PageRef]>) -> Self {
        let mut p = Self::default();
        for t in tables {
            p.offsets.push(p.entries.len() as u32);
            p.lens.push(t.len() as u32);
            p.entries.extend(t.iter().map(|&e| pack(e)));
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_pack_generation_above_page_and_back() {
        let e = PageRef {
            page: 0xdead_beef,
            generation: 7,
        };
        assert_eq!(pack(e), (7u64 << 32) | 0xdead_beef);
        assert_eq!(unpack(pack(e)), (0xdead_beef, 7));
        // Only the low 32 bits of a generation cross.
        let big = PageRef {
            page: 3,
            generation: (5u64 << 32) | 9,
        };
        assert_eq!(unpack(pack(big)), (3, 9));
    }

    #[test]
    fn tables_pack_back_to_back_with_offsets() {
        let a = [
            PageRef {
                page: 1,
                generation: 1,
            },
            PageRef {
                page: 2,
                generation: 3,
            },
        ];
        let b: [PageRef; 0] = [];
        let c = [PageRef {
            page: 9,
            generation: 5,
        }];
        let p = PackedTables::new([&a[..], &b[..], &c[..]]);
        assert_eq!(p.offsets, vec![0, 2, 2]);
        assert_eq!(p.lens, vec![2, 0, 1]);
        assert_eq!(p.entries, vec![pack(a[0]), pack(a[1]), pack(c[0])]);
    }

    #[test]
    fn every_record_kind_decodes_to_the_cpu_pools_error() {
        let rec = |kind, page, layer, expected, actual, position| Violation {
            kind,
            page,
            layer,
            expected,
            actual,
            position,
            pad: [0; 2],
        };
        assert_eq!(rec(0, 0, 0, 0, 0, 0).decode(8), Decoded::Clean);
        assert_eq!(
            rec(1, 99, 2, 0, 8, 5).decode(8),
            Decoded::Guard(GuardViolation::PageOutOfRange {
                page: 99,
                n_pages: 8
            })
        );
        assert_eq!(
            rec(2, 3, 2, 5, 6, 40).decode(8),
            Decoded::Guard(GuardViolation::StaleGeneration {
                page: 3,
                expected: 5,
                actual: 6
            })
        );
        assert_eq!(
            rec(3, 3, 4, 16, 9, 40).decode(8),
            Decoded::Guard(GuardViolation::Unwritten {
                page: 3,
                layer: 4,
                requested: 16,
                watermark: 9
            })
        );
        assert_eq!(
            rec(4, 2, 0, 3, 2, 47).decode(8),
            Decoded::Guard(GuardViolation::TableTooShort {
                position: 47,
                needed: 2,
                len: 2
            })
        );
        assert_eq!(
            rec(5, 3, 1, 7, 4, 23).decode(8),
            Decoded::WriteGap {
                page: 3,
                layer: 1,
                slot: 7,
                watermark: 4
            }
        );
        assert_eq!(
            rec(6, 3, 0, 8, 0, 5).decode(8),
            Decoded::SharedPage {
                position: 5,
                cached: 8
            }
        );
        let odd = rec(77, 1, 1, 1, 1, 1);
        assert_eq!(odd.decode(8), Decoded::Unknown { raw: odd });
    }

    #[test]
    fn records_round_trip_through_device_words() {
        let r = Violation {
            kind: 2,
            page: 4,
            layer: 5,
            expected: 6,
            actual: 7,
            position: 8,
            pad: [0; 2],
        };
        assert_eq!(Violation::from_words(&r.to_words()), r);
        assert_eq!(
            std::mem::size_of::<Violation>(),
            32,
            "the device struct's size"
        );
        assert_eq!(
            Violation::from_words(&[1]).kind,
            1,
            "a short slice reads zeros"
        );
    }
}
