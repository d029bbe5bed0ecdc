//! The file's layout: header fields, lane table, page-owner table and page
//! data offsets,
//! computed with checked arithmetic ([`ShmLayout`]), and the header's
//! encoding and checked decoding (see the module documentation for the byte
//! layout).

use kvmesh_kernels::{KvDtype, KvEntry};

/// Bytes reserved for the header; also where the lanes start.
pub const HEADER_LEN: usize = 4096;
/// Bytes per lane: one cache line.
pub const LANE_STRIDE: usize = 64;
/// Alignment of the page data.
pub(super) const DATA_ALIGN: usize = 4096;
const MAGIC: [u8; 8] = *b"KVMSHM01";
/// 2: the page-owner table after the lanes, the lane's writer count a
/// 64-bit word at +8, and the refusal counter in the header. 3: the entry
/// code at +72 (0: K and V blocks, 1: one latent block per layer).
const VERSION: u32 = 3;
/// The header's dtype codes (the wire's: [`kvmesh_kvwire::Dtype::code`]).
const DTYPE_F32: u32 = 1;
const DTYPE_F16: u32 = 2;
/// Bytes of the header actually used (the rest of [`HEADER_LEN`] is zero).
pub(super) const HEADER_USED: usize = 76;
/// Where, inside the header's reserved bytes, the `AtomicU64` count of
/// writes refused for leaving their grant's pages lives (written by the
/// writers' processes, read by the decode node).
pub(super) const REFUSED_OUTSIDE_GRANT: usize = 128;
/// Bytes per page-owner entry (an `AtomicU64`: the key of the grant that
/// may write the page, 0 for none).
pub(super) const OWNER_STRIDE: usize = 8;

/// The shape of a shared-memory pool: page geometry and lane count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShmLayout {
    /// Token slots per page.
    pub page_size: u32,
    /// Transformer layers.
    pub n_layers: u32,
    /// KV heads per layer.
    pub n_kv_heads: u32,
    /// Values per head.
    pub head_dim: u32,
    /// Element type of the page data.
    pub dtype: KvDtype,
    /// What a slot's entry of one layer holds: K and V blocks, or one
    /// latent block.
    pub entry: KvEntry,
    /// Pages in the pool.
    pub n_pages: u64,
    /// Write gates; lane indices are `u32`, so at most 2^32.
    pub n_lanes: u64,
}

/// Sizes derived from a valid layout, all in range of `usize` and `isize`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Sizes {
    pub(super) kv_dim: usize,
    /// Values of one (page, layer) K or V block.
    pub(super) block: usize,
    /// Blocks per (page, layer): 2 (K, V) or 1 (latent).
    pub(super) blocks: usize,
    /// Values of one page.
    pub(super) page_values: usize,
    /// Start of the page-owner table (the end of the lanes).
    pub(super) owners_offset: usize,
    pub(super) data_offset: usize,
    pub(super) total_len: usize,
}

/// Why a layout is unusable.
pub(super) enum LayoutFault {
    Zero(&'static str),
    TooManyLanes(u64),
    Overflow,
}

impl LayoutFault {
    pub(super) fn reason(&self) -> String {
        match self {
            Self::Zero(field) => format!("{field} is 0"),
            Self::TooManyLanes(n) => format!("n_lanes {n} exceeds 2^32"),
            Self::Overflow => "sizes overflow the address space".to_owned(),
        }
    }
}

impl ShmLayout {
    pub(super) fn sizes(&self) -> Result<Sizes, LayoutFault> {
        for (field, v) in [
            ("page_size", u64::from(self.page_size)),
            ("n_layers", u64::from(self.n_layers)),
            ("n_kv_heads", u64::from(self.n_kv_heads)),
            ("head_dim", u64::from(self.head_dim)),
            ("n_pages", self.n_pages),
            ("n_lanes", self.n_lanes),
        ] {
            if v == 0 {
                return Err(LayoutFault::Zero(field));
            }
        }
        if self.n_lanes > 1 << 32 {
            return Err(LayoutFault::TooManyLanes(self.n_lanes));
        }
        let us = |v: u64| usize::try_from(v).ok();
        let f = || -> Option<Sizes> {
            let kv_dim =
                us(u64::from(self.n_kv_heads))?.checked_mul(us(u64::from(self.head_dim))?)?;
            let block = us(u64::from(self.page_size))?.checked_mul(kv_dim)?;
            let blocks = self.entry.blocks();
            let page_values = us(u64::from(self.n_layers))?
                .checked_mul(blocks)?
                .checked_mul(block)?;
            let lanes_end = us(self.n_lanes)?
                .checked_mul(LANE_STRIDE)?
                .checked_add(HEADER_LEN)?;
            let owners_end = us(self.n_pages)?
                .checked_mul(OWNER_STRIDE)?
                .checked_add(lanes_end)?;
            let data_offset = owners_end.checked_next_multiple_of(DATA_ALIGN)?;
            let data_bytes = us(self.n_pages)?
                .checked_mul(page_values)?
                .checked_mul(self.dtype.size())?;
            let total_len = data_offset.checked_add(data_bytes)?;
            // Pointer offsets must fit in isize; header fields are u64.
            isize::try_from(total_len).ok()?;
            u64::try_from(total_len).ok()?;
            Some(Sizes {
                kv_dim,
                block,
                blocks,
                page_values,
                owners_offset: lanes_end,
                data_offset,
                total_len,
            })
        };
        f().ok_or(LayoutFault::Overflow)
    }

    /// Values per page (all layers, K and V); `None` if the layout is
    /// invalid (a zero field, more than 2^32 lanes, or an overflow).
    pub fn page_values(&self) -> Option<usize> {
        self.sizes().ok().map(|s| s.page_values)
    }

    /// Byte offset of the page data; `None` if the layout is invalid.
    pub fn data_offset(&self) -> Option<usize> {
        self.sizes().ok().map(|s| s.data_offset)
    }

    /// Bytes of the whole file; `None` if the layout is invalid.
    pub fn total_len(&self) -> Option<usize> {
        self.sizes().ok().map(|s| s.total_len)
    }
}

pub(super) fn encode_header(l: &ShmLayout, s: &Sizes) -> [u8; HEADER_USED] {
    let mut h = [0u8; HEADER_USED];
    h[0..8].copy_from_slice(&MAGIC);
    let u32s = [
        VERSION,
        l.page_size,
        l.n_layers,
        l.n_kv_heads,
        l.head_dim,
        match l.dtype {
            KvDtype::F32 => DTYPE_F32,
            KvDtype::F16 => DTYPE_F16,
        },
    ];
    for (i, v) in u32s.iter().enumerate() {
        h[8 + 4 * i..12 + 4 * i].copy_from_slice(&v.to_le_bytes());
    }
    // usize -> u64 is lossless: `sizes` checked the total fits in u64.
    let u64s = [
        l.n_pages,
        l.n_lanes,
        HEADER_LEN as u64,
        s.data_offset as u64,
        s.total_len as u64,
    ];
    for (i, v) in u64s.iter().enumerate() {
        h[32 + 8 * i..40 + 8 * i].copy_from_slice(&v.to_le_bytes());
    }
    let entry: u32 = match l.entry {
        KvEntry::KeyValue => 0,
        KvEntry::Latent => 1,
    };
    h[72..76].copy_from_slice(&entry.to_le_bytes());
    h
}

/// Parses and validates a header against the file's length.
pub(super) fn decode_header(
    h: &[u8; HEADER_USED],
    file_len: u64,
) -> Result<(ShmLayout, Sizes), String> {
    let u32_at = |o: usize| u32::from_le_bytes([h[o], h[o + 1], h[o + 2], h[o + 3]]);
    let u64_at = |o: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&h[o..o + 8]);
        u64::from_le_bytes(b)
    };
    if h[0..8] != MAGIC {
        return Err(format!(
            "magic is {:02x?}, expected {:02x?}",
            &h[0..8],
            MAGIC
        ));
    }
    let version = u32_at(8);
    if version != VERSION {
        return Err(format!("version is {version}, expected {VERSION}"));
    }
    let dtype = match u32_at(28) {
        DTYPE_F32 => KvDtype::F32,
        DTYPE_F16 => KvDtype::F16,
        other => {
            return Err(format!(
                "dtype is {other}, expected {DTYPE_F32} (f32) or {DTYPE_F16} (f16)"
            ))
        }
    };
    let entry = match u32_at(72) {
        0 => KvEntry::KeyValue,
        1 => KvEntry::Latent,
        other => {
            return Err(format!(
                "entry is {other}, expected 0 (key-value) or 1 (latent)"
            ))
        }
    };
    let layout = ShmLayout {
        page_size: u32_at(12),
        n_layers: u32_at(16),
        n_kv_heads: u32_at(20),
        head_dim: u32_at(24),
        dtype,
        entry,
        n_pages: u64_at(32),
        n_lanes: u64_at(40),
    };
    let sizes = layout.sizes().map_err(|f| f.reason())?;
    // Equality with the recomputed values also gives the alignments
    // (lanes at 4096, a multiple of 64; data at a multiple of 4096).
    for (field, found, want) in [
        ("lanes_offset", u64_at(48), HEADER_LEN as u64),
        ("data_offset", u64_at(56), sizes.data_offset as u64),
        ("total_len", u64_at(64), sizes.total_len as u64),
        ("file length", file_len, sizes.total_len as u64),
    ] {
        if found != want {
            return Err(format!("{field} is {found}, expected {want}"));
        }
    }
    Ok((layout, sizes))
}
