//! The pool's error type. Read-path failures are not here: a read that would
//! break I1 or I2 is a [`kvmesh_kernels::GuardViolation`], counted by the pool.

use thiserror::Error;

/// Why a pool operation was refused. Every variant means nothing was
/// allocated, written or changed by the failed call.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum PoolError {
    /// A [`crate::PoolConfig`] field is unusable.
    #[error("invalid KV pool config: {field} = {value}: {reason}")]
    InvalidConfig {
        /// The offending field.
        field: &'static str,
        /// Its value.
        value: usize,
        /// Why it was refused.
        reason: &'static str,
    },
    /// The allocator could not provide the pool's storage.
    #[error("out of memory: the KV pool needs {bytes} bytes")]
    OutOfMemory {
        /// Bytes requested.
        bytes: usize,
    },
    /// Not enough free pages. No pages were taken (no partial grants).
    #[error("KV pool exhausted: {requested_pages} pages requested, {free_pages} free")]
    Exhausted {
        /// Pages the request needed.
        requested_pages: usize,
        /// Pages free when it was refused.
        free_pages: usize,
    },
    /// A write reaches a position the reservation does not cover.
    #[error("position {position} is beyond the reservation's capacity of {capacity} tokens")]
    PositionOutOfRange {
        /// First position that does not fit.
        position: usize,
        /// Tokens the reservation covers.
        capacity: usize,
    },
    /// The layer index is outside the pool's layer count.
    #[error("layer {layer} is out of range: the pool has {n_layers} layers")]
    LayerOutOfRange {
        /// Layer requested.
        layer: usize,
        /// Layers in the pool.
        n_layers: usize,
    },
    /// A K or V buffer has the wrong number of values.
    #[error("{field} has {got} values, expected {expected}")]
    BadLength {
        /// `"k"` or `"v"`.
        field: &'static str,
        /// Values expected: whole tokens of `kv_dim` values, and as many for
        /// V as for K.
        expected: usize,
        /// Values given.
        got: usize,
    },
    /// A write would leave unwritten slots below it: writes to a page must
    /// be contiguous from slot 0 (I2's watermark is a single number).
    #[error("write gap: page {page} layer {layer} slot {slot} is above the written watermark {watermark}")]
    WriteGap {
        /// Physical page.
        page: u32,
        /// Layer.
        layer: usize,
        /// First slot the write would fill.
        slot: usize,
        /// Slots already written contiguously from 0.
        watermark: usize,
    },
    /// A write to a position of the reservation's cached head: those pages
    /// are shared with other sequences and immutable.
    #[error("position {position} is in the cached prefix ({cached} tokens), which is read-only")]
    SharedPage {
        /// The position written.
        position: usize,
        /// Tokens of the cached head.
        cached: usize,
    },
    /// The pool has minted 2^64 - 1 owner tags and will not reuse one.
    /// Unreachable in practice (584 years at a billion reservations per
    /// second); a typed error rather than a panic or a reused tag.
    #[error("owner tags exhausted: the pool will not reuse an owner tag")]
    OwnerTagsExhausted,
    /// A page observer (a device pool's mirror) was offered to a pool that
    /// already has one or has already handed out pages: the observer could
    /// not know every page's state.
    #[error("a page observer must be set once, before the pool's first allocation")]
    ObserverTooLate,
}

impl PoolError {
    /// A short stable name, used as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::InvalidConfig { .. } => "invalid_config",
            Self::OutOfMemory { .. } => "out_of_memory",
            Self::Exhausted { .. } => "exhausted",
            Self::PositionOutOfRange { .. } => "position_out_of_range",
            Self::LayerOutOfRange { .. } => "layer_out_of_range",
            Self::BadLength { .. } => "bad_length",
            Self::WriteGap { .. } => "write_gap",
            Self::SharedPage { .. } => "shared_page",
            Self::OwnerTagsExhausted => "owner_tags_exhausted",
            Self::ObserverTooLate => "observer_too_late",
        }
    }
}
