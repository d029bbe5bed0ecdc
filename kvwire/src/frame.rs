//! The data frame: one slot range of some layers of one granted page.

use std::fmt;
use std::ops::Range;

use kvmesh_kernels::PageRef;

use super::codec::{fit, seal, Put, Reader};
use super::error::WireError;
use super::geometry::{Dtype, Geometry, GEOMETRY_LEN};
use super::ids::{Capability, ReservationId, CAPABILITY_LEN};
use super::{MessageType, HEADER_LEN, TRAILER_LEN};

/// Bytes of a frame body before the payload.
pub const FRAME_FIXED_LEN: usize =
    16 + CAPABILITY_LEN + 4 + 4 + 8 + GEOMETRY_LEN + 2 + 2 + 4 + 4 + 4;

/// KV values for slots `slots` of layers `layers` of one granted page.
///
/// The payload is, for each layer in `layers` in order, the K values of
/// those slots then the V values (each `[n_slots][n_kv_heads][head_dim]`),
/// as little-endian values of the geometry's dtype (f32 or f16): the page's
/// own layout restricted to the range, so
/// a frame of all layers and all slots is the page's bytes as they lie in
/// the pool. Decoding borrows the payload from the input buffer.
///
/// A decoded frame is well-formed (lengths match its geometry, ranges lie
/// in the page); whether it may be written is [`super::Grant::check_frame`]'s
/// question, and the pool's (is the page still at that generation).
#[derive(Clone, PartialEq, Eq)]
pub struct KvFrame<'a> {
    /// The reservation the pages belong to.
    pub reservation: ReservationId,
    /// The grant's write capability.
    pub capability: Capability,
    /// Logical index of the page in the grant's page list.
    pub page_index: u32,
    /// The physical page and the generation it was granted at.
    pub page: PageRef,
    /// The page shape; must equal the grant's.
    pub geometry: Geometry,
    /// Layers covered, `first..end`, non-empty, `end <= n_layers`.
    pub layers: Range<u16>,
    /// Slots covered within the page, non-empty, `end <= page_size`.
    pub slots: Range<u32>,
    /// The values, as described above.
    pub payload: &'a [u8],
}

/// The K and V bytes of one layer of a frame's payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerKv<'a> {
    /// The layer.
    pub layer: u16,
    /// K values of the frame's slots, little-endian, of the geometry's dtype.
    pub k: &'a [u8],
    /// V values of the frame's slots, little-endian, of the geometry's dtype;
    /// empty for latent entries.
    pub v: &'a [u8],
}

impl<'a> KvFrame<'a> {
    /// Slots covered.
    pub fn n_slots(&self) -> u32 {
        self.slots.end.saturating_sub(self.slots.start)
    }

    /// Bytes this frame takes on the wire.
    pub fn encoded_len(&self) -> usize {
        HEADER_LEN + FRAME_FIXED_LEN + self.payload.len() + TRAILER_LEN
    }

    /// The payload, layer by layer. Empty if the geometry is degenerate;
    /// a decoded (or successfully encoded) frame yields `layers.len()`
    /// items.
    pub fn layer_blocks(&self) -> impl Iterator<Item = LayerKv<'a>> + 'a {
        // Bytes of one layer: its K block, then (key-value entries) its V
        // block of the same size.
        let layer = self
            .geometry
            .payload_len(&(0..1), self.n_slots())
            .and_then(|b| usize::try_from(b).ok())
            .unwrap_or(0);
        let block = layer / self.geometry.entry.blocks();
        let chunks = match layer {
            0 => <&[u8]>::default().chunks_exact(1),
            b => self.payload.chunks_exact(b),
        };
        self.layers.clone().zip(chunks).map(move |(layer, kv)| {
            let (k, v) = kv.split_at(block);
            LayerKv { layer, k, v }
        })
    }

    /// Checks what the decoder checks: a valid geometry, non-empty ranges
    /// inside the page, and a payload of exactly the geometry's length.
    pub fn validate(&self) -> Result<(), WireError> {
        self.geometry.validate()?;
        let g = &self.geometry;
        if self.layers.start >= self.layers.end {
            return Err(WireError::InvalidField {
                field: "layers.end",
                value: self.layers.end.into(),
                reason: "the layer range is empty: end must exceed start",
            });
        }
        if self.layers.end > g.n_layers {
            return Err(WireError::InvalidField {
                field: "layers.end",
                value: self.layers.end.into(),
                reason: "past geometry.n_layers",
            });
        }
        if self.slots.start >= self.slots.end {
            return Err(WireError::InvalidField {
                field: "slots.n",
                value: self.n_slots().into(),
                reason: "the slot range is empty",
            });
        }
        if self.slots.end > g.page_size {
            return Err(WireError::InvalidField {
                field: "slots.end",
                value: self.slots.end.into(),
                reason: "past geometry.page_size",
            });
        }
        let expected = g.payload_len(&self.layers, self.n_slots());
        if expected != Some(self.payload.len() as u64) {
            return Err(WireError::LengthMismatch {
                field: "payload",
                declared: self.payload.len() as u64,
                actual: expected.unwrap_or(u64::MAX),
            });
        }
        Ok(())
    }

    /// Appends the encoded frame to `out`; returns the bytes appended. A
    /// frame the decoder would refuse is refused here, and nothing is
    /// appended.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<usize, WireError> {
        self.validate()?;
        let payload_len: u32 = fit(self.payload.len(), "payload")?;
        seal(
            MessageType::KvFrame,
            FRAME_FIXED_LEN + self.payload.len(),
            out,
            |o| {
                o.put_id(&self.reservation);
                o.put_capability(&self.capability);
                o.put_u32(self.page_index);
                o.put_u32(self.page.page);
                o.put_u64(self.page.generation);
                self.geometry.put(o);
                o.put_u16(self.layers.start);
                o.put_u16(self.layers.end);
                o.put_u32(self.slots.start);
                o.put_u32(self.n_slots());
                o.put_u32(payload_len);
                o.extend_from_slice(self.payload);
            },
        )
    }

    /// Decodes a frame body (the envelope is already checked).
    pub(crate) fn decode_body(body: &'a [u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(body);
        let reservation = r.id("reservation")?;
        let capability = r.capability()?;
        let page_index = r.u32("page_index")?;
        let page = PageRef {
            page: r.u32("page")?,
            generation: r.u64("generation")?,
        };
        let geometry = Geometry::read(&mut r)?;
        let layers = r.u16("layers.start")?..r.u16("layers.end")?;
        let slot_start = r.u32("slots.start")?;
        let n_slots = r.u32("slots.n")?;
        let slot_end = slot_start
            .checked_add(n_slots)
            .ok_or(WireError::InvalidField {
                field: "slots.n",
                value: n_slots.into(),
                reason: "slots.start + slots.n overflows",
            })?;
        let payload_len = r.u32("payload_len")?;
        if payload_len as usize != r.remaining() {
            return Err(WireError::LengthMismatch {
                field: "payload_len",
                declared: payload_len.into(),
                actual: r.remaining() as u64,
            });
        }
        let payload = r.take(payload_len as usize, "payload")?;
        r.finish("frame")?;
        let frame = Self {
            reservation,
            capability,
            page_index,
            page,
            geometry,
            layers,
            slots: slot_start..slot_end,
            payload,
        };
        frame.validate()?;
        Ok(frame)
    }
}

/// The payload is summarised, not dumped (a page is 720 KiB); the
/// capability prints redacted.
impl fmt::Debug for KvFrame<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvFrame")
            .field("reservation", &self.reservation)
            .field("capability", &self.capability)
            .field("page_index", &self.page_index)
            .field("page", &self.page)
            .field("geometry", &self.geometry)
            .field("layers", &self.layers)
            .field("slots", &self.slots)
            .field("payload_bytes", &self.payload.len())
            .finish()
    }
}

/// Appends `values` as little-endian f32 bytes (a frame payload).
pub fn f32s_to_le(values: &[f32], out: &mut Vec<u8>) {
    #[cfg(target_endian = "little")]
    out.extend_from_slice(bytemuck::cast_slice(values));
    #[cfg(not(target_endian = "little"))]
    out.extend(values.iter().flat_map(|v| v.to_le_bytes()));
}

/// Appends `values` in `dtype`'s little-endian encoding (a frame payload,
/// or what its checksum covers): f32 as they are; f16 rounded by
/// [`kvmesh_kernels::f16_from_f32`], which is exact for values read from an
/// f16 pool.
pub fn encode_values(dtype: Dtype, values: &[f32], out: &mut Vec<u8>) {
    match dtype {
        Dtype::F32 => f32s_to_le(values, out),
        Dtype::F16 => {
            out.reserve(values.len() * 2);
            // Through a small buffer, converted eight at a time.
            let mut buf = [half::f16::ZERO; 512];
            for chunk in values.chunks(buf.len()) {
                let h = &mut buf[..chunk.len()];
                kvmesh_kernels::f32_to_f16_slice(chunk, h);
                #[cfg(target_endian = "little")]
                out.extend_from_slice(bytemuck::cast_slice(h));
                #[cfg(not(target_endian = "little"))]
                h.iter()
                    .for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
            }
        }
    }
}

/// Fills `out` from little-endian f16 bytes; `bytes` must hold exactly
/// `2 * out.len()` bytes. Copies, so `bytes` need not be aligned.
pub fn f16s_from_le(bytes: &[u8], out: &mut [half::f16]) -> Result<(), WireError> {
    values_from_le(bytes, out, "f16 values", half::f16::from_le_bytes)
}

/// Fills `out` from little-endian f32 bytes; `bytes` must hold exactly
/// `4 * out.len()` bytes. Copies, so `bytes` need not be aligned.
pub fn f32s_from_le(bytes: &[u8], out: &mut [f32]) -> Result<(), WireError> {
    values_from_le(bytes, out, "f32 values", f32::from_le_bytes)
}

/// `out[i] = from(bytes[N * i..N * (i + 1)])`, refused unless the lengths
/// match exactly.
fn values_from_le<T, const N: usize>(
    bytes: &[u8],
    out: &mut [T],
    field: &'static str,
    from: fn([u8; N]) -> T,
) -> Result<(), WireError> {
    if bytes.len() != out.len().saturating_mul(N) {
        return Err(WireError::LengthMismatch {
            field,
            declared: bytes.len() as u64,
            actual: (out.len() as u64).saturating_mul(N as u64),
        });
    }
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(N)) {
        let mut a = [0u8; N];
        a.copy_from_slice(b);
        *o = from(a);
    }
    Ok(())
}
