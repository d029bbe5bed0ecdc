//! The page shape as it travels in grants and frames.

use std::ops::Range;

use kvmesh_kernels::{KvDtype, KvEntry, KvGeometry};

use super::codec::{Put, Reader};
use super::error::WireError;

/// Element type of the KV values on the wire: the pool's [`KvDtype`], sent
/// as stored (a frame's payload is the page's own bytes). A new dtype is a
/// new code (receivers refuse codes they do not know), not a new layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// IEEE 754 binary32, little-endian. Code 1.
    F32,
    /// IEEE 754 binary16, little-endian. Code 2.
    F16,
}

impl Dtype {
    /// The wire code.
    pub fn code(self) -> u8 {
        match self {
            Self::F32 => 1,
            Self::F16 => 2,
        }
    }

    /// Bytes per value.
    pub fn size(self) -> u64 {
        match self {
            Self::F32 => 4,
            Self::F16 => 2,
        }
    }

    /// The pool element type it carries.
    pub fn kv(self) -> KvDtype {
        match self {
            Self::F32 => KvDtype::F32,
            Self::F16 => KvDtype::F16,
        }
    }

    fn from_code(code: u8) -> Result<Self, WireError> {
        match code {
            1 => Ok(Self::F32),
            2 => Ok(Self::F16),
            _ => Err(WireError::InvalidField {
                field: "geometry.dtype",
                value: code.into(),
                reason: "unknown dtype code (1 = f32, 2 = f16)",
            }),
        }
    }
}

impl From<KvDtype> for Dtype {
    fn from(d: KvDtype) -> Self {
        match d {
            KvDtype::F32 => Self::F32,
            KvDtype::F16 => Self::F16,
        }
    }
}

/// Bytes of an encoded [`Geometry`].
pub const GEOMETRY_LEN: usize = 12;

/// The shape of a page: the grant states it, every frame repeats it, so a
/// frame's lengths can be checked on its own and then against its grant.
///
/// Encoded in 12 bytes: `page_size` u32, `n_layers` u16, `n_kv_heads` u16,
/// `head_dim` u16, dtype code u8, entry code u8 (0: key and value, 1:
/// latent; it keeps a frame's payload 8-aligned within the message, and a
/// receiver that only knows code 0 refuses 1 instead of misreading it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Geometry {
    /// Token slots per page.
    pub page_size: u32,
    /// Transformer layers; a page holds all of them.
    pub n_layers: u16,
    /// Key/value heads.
    pub n_kv_heads: u16,
    /// Dimension of one head.
    pub head_dim: u16,
    /// Element type.
    pub dtype: Dtype,
    /// What a slot's entry of one layer holds: a K and a V block per
    /// layer, or one latent block ([`KvEntry`]).
    pub entry: KvEntry,
}

impl Geometry {
    /// The geometry of pages of this shape (a pool's: `kvmesh_kvxfer`'s
    /// `pool_geometry`); an error names a field the wire cannot carry (over
    /// `u32` slots, over `u16` layers, heads or head dimension) or a zero.
    pub fn new(
        page_size: usize,
        n_layers: usize,
        n_kv_heads: usize,
        head_dim: usize,
        dtype: KvDtype,
        entry: KvEntry,
    ) -> Result<Self, WireError> {
        fn narrow<T: TryFrom<usize>>(v: usize, field: &'static str) -> Result<T, WireError> {
            T::try_from(v).map_err(|_| WireError::InvalidField {
                field,
                value: v as u64,
                reason: "does not fit its wire field",
            })
        }
        let g = Self {
            page_size: narrow(page_size, "geometry.page_size")?,
            n_layers: narrow(n_layers, "geometry.n_layers")?,
            n_kv_heads: narrow(n_kv_heads, "geometry.n_kv_heads")?,
            head_dim: narrow(head_dim, "geometry.head_dim")?,
            dtype: dtype.into(),
            entry,
        };
        g.validate()?;
        Ok(g)
    }

    /// The shape the kernels use.
    pub fn kv_geometry(&self) -> KvGeometry {
        KvGeometry {
            page_size: self.page_size as usize,
            n_kv_heads: self.n_kv_heads.into(),
            head_dim: self.head_dim.into(),
            entry: self.entry,
        }
    }

    /// Values of K (or V) per slot per layer.
    pub fn kv_dim(&self) -> u64 {
        u64::from(self.n_kv_heads) * u64::from(self.head_dim)
    }

    /// Blocks per layer: 2 (K, V) or 1 (latent).
    pub fn blocks(&self) -> u64 {
        self.entry.blocks() as u64
    }

    /// Payload bytes of a frame covering `layers` and `n_slots` slots: per
    /// layer a K block and (key-value entries) a V block of `n_slots *
    /// kv_dim` values. `None` on overflow (no valid frame is that large).
    pub fn payload_len(&self, layers: &Range<u16>, n_slots: u32) -> Option<u64> {
        u64::from(layers.end.checked_sub(layers.start)?)
            .checked_mul(self.blocks())?
            .checked_mul(n_slots.into())?
            .checked_mul(self.kv_dim())?
            .checked_mul(self.dtype.size())
    }

    /// Bytes of a whole page, all layers and slots.
    pub fn page_bytes(&self) -> Option<u64> {
        self.payload_len(&(0..self.n_layers), self.page_size)
    }

    /// Every dimension at least 1.
    pub(crate) fn validate(&self) -> Result<(), WireError> {
        let dims = [
            ("geometry.page_size", u64::from(self.page_size)),
            ("geometry.n_layers", self.n_layers.into()),
            ("geometry.n_kv_heads", self.n_kv_heads.into()),
            ("geometry.head_dim", self.head_dim.into()),
        ];
        for (field, value) in dims {
            if value == 0 {
                return Err(WireError::InvalidField {
                    field,
                    value,
                    reason: "must be at least 1",
                });
            }
        }
        Ok(())
    }

    pub(crate) fn put(&self, out: &mut Vec<u8>) {
        out.put_u32(self.page_size);
        out.put_u16(self.n_layers);
        out.put_u16(self.n_kv_heads);
        out.put_u16(self.head_dim);
        out.put_u8(self.dtype.code());
        out.put_u8(match self.entry {
            KvEntry::KeyValue => 0,
            KvEntry::Latent => 1,
        });
    }

    pub(crate) fn read(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let page_size = r.u32("geometry.page_size")?;
        let n_layers = r.u16("geometry.n_layers")?;
        let n_kv_heads = r.u16("geometry.n_kv_heads")?;
        let head_dim = r.u16("geometry.head_dim")?;
        let dtype = Dtype::from_code(r.u8("geometry.dtype")?)?;
        let entry = match r.u8("geometry.entry")? {
            0 => KvEntry::KeyValue,
            1 => KvEntry::Latent,
            code => {
                return Err(WireError::InvalidField {
                    field: "geometry.entry",
                    value: code.into(),
                    reason: "unknown entry code (0 = key and value, 1 = latent)",
                })
            }
        };
        let g = Self {
            page_size,
            n_layers,
            n_kv_heads,
            head_dim,
            dtype,
            entry,
        };
        g.validate()?;
        Ok(g)
    }
}
