//! The checked read interface between attention and the paged KV pool.
//!
//! A sequence's KV lives in fixed-size pages of a shared pool. The sequence
//! keeps a page table: for each logical page (positions
//! `i * page_size .. (i + 1) * page_size`) a [`PageRef`], the physical page
//! and the generation that page had when the sequence was given it. The pool
//! bumps a page's generation on every allocation and every release, so a
//! page table that outlived its reservation names a generation that no longer
//! exists.
//!
//! Attention never indexes pool memory itself. It asks a [`PagedKv`] for each
//! page, and the implementation must check, before returning any data:
//! - I1: the page's current generation equals `PageRef::generation` and the
//!   page is owned by the sequence doing the read;
//! - I2: every requested slot is below the page's written-slot watermark for
//!   that layer.
//!
//! On failure it returns a [`GuardViolation`] (and the pool counts it); the
//! kernel then fails the whole call without reading anything.

use thiserror::Error;

/// One entry of a sequence's page table: a physical page and the generation
/// the sequence was granted it at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PageRef {
    /// Physical page index in the pool.
    pub page: u32,
    /// Generation of the page when it was granted to the sequence.
    pub generation: u64,
}

/// The shape of one page's KV for one layer.
///
/// Within a page, for each layer, K and V are each stored slot-major:
/// `[page_size][n_kv_heads][head_dim]` f32 values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvGeometry {
    /// Token slots per page.
    pub page_size: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
}

impl KvGeometry {
    /// f32 values of K (or of V) for one token slot of one layer.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

/// The K and V values of the first `n_slots` slots of one page for one layer,
/// each `n_slots * kv_dim` long, slot-major.
#[derive(Clone, Copy, Debug)]
pub struct PageSlices<'a> {
    /// Keys, `[n_slots][n_kv_heads][head_dim]`.
    pub k: &'a [f32],
    /// Values, `[n_slots][n_kv_heads][head_dim]`.
    pub v: &'a [f32],
}

/// A read that would break I1 or I2. The sequence that attempted it fails;
/// no data was read.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum GuardViolation {
    /// The page table names a page the pool does not have.
    #[error("page {page} is out of range: the pool has {n_pages} pages")]
    PageOutOfRange {
        /// Page named by the table.
        page: u32,
        /// Pages in the pool.
        n_pages: u32,
    },
    /// The page was released (and perhaps reallocated) since the sequence
    /// was granted it.
    #[error(
        "stale page table entry: page {page} has generation {actual}, the table says {expected}"
    )]
    StaleGeneration {
        /// Page named by the table.
        page: u32,
        /// Generation recorded in the page table.
        expected: u64,
        /// The page's current generation.
        actual: u64,
    },
    /// The page's generation matches but it belongs to another sequence.
    #[error("page {page} is not owned by this sequence")]
    ForeignPage {
        /// Page named by the table.
        page: u32,
    },
    /// A slot that was never written for this sequence would be read.
    #[error("read of unwritten KV: page {page}, layer {layer}, slots 0..{requested} requested but only {watermark} written")]
    Unwritten {
        /// Page named by the table.
        page: u32,
        /// Layer being read.
        layer: usize,
        /// Slots the read needed.
        requested: usize,
        /// The page's written-slot watermark for that layer.
        watermark: usize,
    },
    /// The read needs more pages than the sequence's page table has.
    #[error("page table too short: position {position} needs logical page {needed}, the table has {len}")]
    TableTooShort {
        /// Highest position attended.
        position: usize,
        /// Logical page index needed.
        needed: usize,
        /// Entries in the table.
        len: usize,
    },
    /// Debug poison mode: the page still held the free-page canary.
    #[error("poison canary read on page {page}, layer {layer}: a read of never-written KV")]
    Poisoned {
        /// Page that held the canary.
        page: u32,
        /// Layer being read.
        layer: usize,
    },
    /// The layer index is outside the pool's layer count.
    #[error("layer {layer} is out of range: the pool has {n_layers} layers")]
    LayerOutOfRange {
        /// Layer requested.
        layer: usize,
        /// Layers in the pool.
        n_layers: usize,
    },
}

impl GuardViolation {
    /// A short stable name, used as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::PageOutOfRange { .. } => "page_out_of_range",
            Self::StaleGeneration { .. } => "stale_generation",
            Self::ForeignPage { .. } => "foreign_page",
            Self::Unwritten { .. } => "unwritten",
            Self::TableTooShort { .. } => "table_too_short",
            Self::Poisoned { .. } => "poisoned",
            Self::LayerOutOfRange { .. } => "layer_out_of_range",
        }
    }
}

/// Checked read access to a sequence's KV pages.
///
/// An implementation is bound to one reader (one sequence); it knows which
/// owner the reader is. Implementations must uphold: `read_page` returns data
/// only after checking I1 (generation and owner of `entry`) and I2
/// (`n_slots` at most the page's watermark for `layer`), and must count every
/// violation it returns.
pub trait PagedKv {
    /// The pool's page shape.
    fn geometry(&self) -> KvGeometry;

    /// The first `n_slots` slots of `entry`'s page at `layer`, after the I1
    /// and I2 checks. Cost: O(1) checks (plus an O(page) canary scan in debug
    /// poison mode).
    fn read_page(
        &self,
        entry: PageRef,
        layer: usize,
        n_slots: usize,
    ) -> Result<PageSlices<'_>, GuardViolation>;

    /// Count a violation that the kernel detected itself (a page table too
    /// short for the positions read), so that every refused read raises the
    /// same alarm as the ones `read_page` refuses.
    fn report(&self, violation: &GuardViolation);
}
