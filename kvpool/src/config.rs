//! Pool configuration: shape, scrubbing (I6) and validation.

use std::fmt;
use std::str::FromStr;

use kvmesh_kernels::{KvDtype, KvEntry, KvGeometry};
use thiserror::Error;

use crate::error::PoolError;

/// When a page's storage is zeroed (I6, "nothing left behind").
///
/// The default is [`ScrubMode::Off`], for two reasons.
///
/// Zeroing is not what protects tenants. The read path, always on, checks
/// every page's generation and owner (I1) and its written-slot watermark
/// (I2), so a page still holding old bytes is read by nobody but the
/// reservation that wrote them; the `scrub_off_*` test proves it with the
/// old bytes left in place. Zeroing alone would not have stopped the
/// incident in `design/kv-safety.md` either: attention over zeroed pages
/// still answers, wrongly and with HTTP 200, where the checks fail the
/// request with a typed error.
///
/// And it costs a full write of the KV once more, paid synchronously by the
/// thread that releases (or allocates): a page is
/// `n_layers * 2 * page_size * kv_dim * 4` bytes. Measured with `cargo test -p kvmesh-kvxfer --release
/// --lib -- --ignored scrub_cost --nocapture` on the project's 2-core EPYC
/// machine class, pages of the default model's shape (30 layers, 16 slots,
/// 3 KV heads of 64: 720 KiB) over a pool larger than the caches: about
/// 100 µs per page zeroed (about 7 GB/s) against 20-35 ns per page for
/// allocation and release without scrubbing. Amortised per generated token
/// that is about 6 µs, small next to a decode step; but it lands all at
/// once where the pages change hands: releasing a 4k-token sequence (256
/// pages) stalls the releasing thread about 25 ms, one or two decode steps
/// of the whole batch, and a 1M-token sequence about 6.5 s.
///
/// Operators who must not keep released KV in memory (dumps, swap, a future
/// transport bug that ships whole pages instead of written slots) choose
/// [`ScrubMode::OnRelease`]: a free page then holds zeros.
/// [`ScrubMode::OnAllocate`] moves the same cost to the allocating request,
/// and leaves released KV in memory until the page is reused.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ScrubMode {
    /// Never zero; the read-path checks alone protect old bytes.
    #[default]
    Off,
    /// Zero a page when it is released, before it rejoins the free list.
    OnRelease,
    /// Zero a page when it is allocated, before its owner can see it.
    OnAllocate,
}

impl ScrubMode {
    /// The name [`FromStr`] accepts.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::OnRelease => "on-release",
            Self::OnAllocate => "on-allocate",
        }
    }
}

impl fmt::Display for ScrubMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A string that names no [`ScrubMode`].
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("unknown scrub mode {value:?}: expected off, on-release or on-allocate")]
pub struct ParseScrubModeError {
    /// The string given.
    pub value: String,
}

impl FromStr for ScrubMode {
    type Err = ParseScrubModeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "off" => Ok(Self::Off),
            "on-release" => Ok(Self::OnRelease),
            "on-allocate" => Ok(Self::OnAllocate),
            _ => Err(ParseScrubModeError {
                value: s.to_owned(),
            }),
        }
    }
}

/// The shape and policies of a [`crate::KvPool`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Token slots per page.
    pub page_size: usize,
    /// Physical pages. Page ids are `u32`, so at most `u32::MAX`.
    pub n_pages: usize,
    /// Transformer layers; every page holds all layers of its slots.
    pub n_layers: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// What a token's entry of one layer holds: a key and a value, or one
    /// latent vector (see [`KvEntry`]); the page's bytes per layer are
    /// [`KvEntry::blocks`] blocks of `page_size * n_kv_heads * head_dim`.
    pub entry: KvEntry,
    /// Element type of the stored K and V values (see [`KvDtype`]): every
    /// page, every transfer of a page, and its checksum use it.
    pub dtype: KvDtype,
    /// When pages are zeroed.
    pub scrub: ScrubMode,
    /// Debug poison mode: fill free pages with a canary NaN (at creation and
    /// on release, never zeroed over on allocation) and scan every read for
    /// it, so a read of never-written KV that got past the watermark check is
    /// caught as [`kvmesh_kernels::GuardViolation::Poisoned`]. Costs a pass
    /// over the whole pool at creation (no lazy zero pages), a page fill per
    /// release, and a scan of every slot read (one more pass over the KV
    /// that attention reads). Overrides `scrub` where the two disagree: a
    /// released page holds the canary, not zeros, and allocation does not
    /// zero it.
    pub poison: bool,
}

impl PoolConfig {
    /// A pool of at least `kv_pool_tokens` tokens: `ceil(kv_pool_tokens /
    /// page_size)` pages, key-value entries, f32 values, scrub off, poison off. A `page_size` of 0 gives 0
    /// pages; [`PoolConfig::validate`] rejects both.
    pub fn for_tokens(
        kv_pool_tokens: usize,
        page_size: usize,
        n_layers: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> Self {
        let n_pages = match page_size {
            0 => 0,
            p => kv_pool_tokens.div_ceil(p),
        };
        Self {
            page_size,
            n_pages,
            n_layers,
            n_kv_heads,
            head_dim,
            entry: KvEntry::KeyValue,
            dtype: KvDtype::F32,
            scrub: ScrubMode::Off,
            poison: false,
        }
    }

    /// This config with values of `dtype`.
    pub fn with_dtype(self, dtype: KvDtype) -> Self {
        Self { dtype, ..self }
    }

    /// This config with entries of `entry`.
    pub fn with_entry(self, entry: KvEntry) -> Self {
        Self { entry, ..self }
    }

    /// Checks every field; the error names the first bad one, its value and
    /// the reason.
    pub fn validate(&self) -> Result<(), PoolError> {
        let nonzero = [
            ("page_size", self.page_size),
            ("n_pages", self.n_pages),
            ("n_layers", self.n_layers),
            ("n_kv_heads", self.n_kv_heads),
            ("head_dim", self.head_dim),
        ];
        for (field, value) in nonzero {
            if value == 0 {
                return Err(PoolError::InvalidConfig {
                    field,
                    value,
                    reason: "must be at least 1",
                });
            }
        }
        if u32::try_from(self.n_pages).is_err() {
            return Err(PoolError::InvalidConfig {
                field: "n_pages",
                value: self.n_pages,
                reason: "page ids are u32: at most 4294967295 pages",
            });
        }
        match self.checked_bytes() {
            Some(b) if isize::try_from(b).is_ok() => Ok(()),
            _ => Err(PoolError::InvalidConfig {
                field: "n_pages",
                value: self.n_pages,
                reason: "the pool's size in bytes (n_pages * n_layers * blocks * page_size * n_kv_heads * head_dim * dtype size) overflows isize",
            }),
        }
    }

    /// Bytes of KV storage the pool holds (metadata, about 16 bytes a page
    /// plus 8 a page and layer, not included). Saturates at `usize::MAX` for
    /// a config that [`PoolConfig::validate`] rejects.
    pub fn bytes(&self) -> usize {
        self.checked_bytes().unwrap_or(usize::MAX)
    }

    /// The page shape the kernels see.
    pub fn geometry(&self) -> KvGeometry {
        KvGeometry {
            page_size: self.page_size,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            entry: self.entry,
        }
    }

    /// Values in the whole pool, `None` on overflow.
    pub(crate) fn checked_values(&self) -> Option<usize> {
        self.n_pages
            .checked_mul(self.n_layers)?
            .checked_mul(self.entry.blocks())?
            .checked_mul(self.page_size)?
            .checked_mul(self.n_kv_heads)?
            .checked_mul(self.head_dim)
    }

    fn checked_bytes(&self) -> Option<usize> {
        self.checked_values()?.checked_mul(self.dtype.size())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> PoolConfig {
        PoolConfig::for_tokens(10, 4, 2, 2, 8)
    }

    #[test]
    fn for_tokens_rounds_pages_up() {
        let c = small();
        assert_eq!(c.n_pages, 3);
        assert_eq!((c.scrub, c.poison), (ScrubMode::Off, false));
        assert_eq!(c.bytes(), 3 * 2 * 2 * 4 * 2 * 8 * 4);
        assert_eq!(PoolConfig::for_tokens(8, 4, 1, 1, 1).n_pages, 2);
        assert_eq!(PoolConfig::for_tokens(8, 0, 1, 1, 1).n_pages, 0);
        assert_eq!(c.geometry().kv_dim(), 16);
        c.validate().expect("small config is valid");
        // A latent entry stores one block per layer, not two.
        let latent = c.clone().with_entry(KvEntry::Latent);
        assert_eq!(latent.bytes() * 2, c.bytes());
        assert_eq!(latent.geometry().layer_values(), 4 * 16);
    }

    #[test]
    fn each_zero_field_is_named() {
        type Zero = fn(&mut PoolConfig);
        let fields: [(&str, Zero); 5] = [
            ("page_size", |c| c.page_size = 0),
            ("n_pages", |c| c.n_pages = 0),
            ("n_layers", |c| c.n_layers = 0),
            ("n_kv_heads", |c| c.n_kv_heads = 0),
            ("head_dim", |c| c.head_dim = 0),
        ];
        for (name, zero) in fields {
            let mut c = small();
            zero(&mut c);
            let err = c.validate().expect_err(name);
            assert!(
                matches!(err, PoolError::InvalidConfig { field, value: 0, .. } if field == name),
                "{err:?}"
            );
            assert_eq!(err.kind(), "invalid_config");
            assert!(err.to_string().contains(&format!("{name} = 0")), "{err}");
        }
    }

    #[test]
    fn oversized_pools_are_refused() {
        let mut c = small();
        c.n_pages = usize::MAX;
        let err = c.validate().expect_err("u32 page ids");
        assert!(
            matches!(
                err,
                PoolError::InvalidConfig {
                    field: "n_pages",
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("u32"), "{err}");

        let mut c = small();
        c.n_pages = u32::MAX as usize;
        c.head_dim = usize::MAX / 2;
        let err = c.validate().expect_err("byte overflow");
        assert!(err.to_string().contains("overflows"), "{err}");
        assert_eq!(c.bytes(), usize::MAX);
    }

    #[test]
    fn scrub_mode_parses_and_names_bad_values() {
        for m in [ScrubMode::Off, ScrubMode::OnRelease, ScrubMode::OnAllocate] {
            assert_eq!(m.to_string().parse::<ScrubMode>(), Ok(m));
        }
        assert_eq!(ScrubMode::default(), ScrubMode::Off);
        let err = "on_release"
            .parse::<ScrubMode>()
            .expect_err("underscore is not accepted");
        assert_eq!(err.value, "on_release");
        assert!(err.to_string().contains("\"on_release\""), "{err}");
    }
}
