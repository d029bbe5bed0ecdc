//! The grant: what a decode node hands out for a reservation, and the check
//! every incoming frame must pass against it.

use kvmesh_kernels::PageRef;

use super::codec::{fit, seal, Put, Reader};
use super::error::{FrameReject, WireError};
use super::frame::KvFrame;
use super::geometry::{Geometry, GEOMETRY_LEN};
use super::ids::{ct_eq, Capability, ReservationId, CAPABILITY_LEN};
use super::{MessageType, HEADER_LEN, TRAILER_LEN};

/// Bytes of a grant body before the page list.
pub const GRANT_FIXED_LEN: usize = 16 + CAPABILITY_LEN + GEOMETRY_LEN + 8 + 8 + 8 + 8 + 4 + 2;
/// Bytes per page list entry: page id u32, generation u64.
pub const PAGE_ENTRY_LEN: usize = 12;

/// A decode node's answer to Reserve: pages for exactly the prompt's
/// tokens that the decode node does not hold already, and the right to
/// write them.
///
/// Well-formed means: `prompt_tokens >= 1`, `cached_tokens` a multiple of
/// the page size and below `prompt_tokens`, exactly
/// `ceil((prompt_tokens - cached_tokens) / page_size)` pages (no partial
/// grants, no spare pages the writer could reach), a valid geometry, a
/// non-empty UTF-8 endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    /// The reservation, minted by the decode node.
    pub reservation: ReservationId,
    /// The secret every frame and `TransferDone` for this grant must show.
    pub capability: Capability,
    /// Shape of the pages.
    pub geometry: Geometry,
    /// The prompt's length. The transfer writes exactly positions
    /// `cached_tokens..prompt_tokens`.
    pub prompt_tokens: u64,
    /// Leading prompt positions the decode node has from its prefix cache
    /// (whole pages): the writer skips them, and page `0` of the grant
    /// starts at position `cached_tokens`.
    pub cached_tokens: u64,
    /// When the grant lapses, in milliseconds since the Unix epoch. After it
    /// the decode node revokes and frees (I5: never frees on the deadline
    /// alone).
    pub lease_deadline_unix_ms: u64,
    /// The transport's key for this grant's write path, opaque to the
    /// writer: 0 where the receiver checks every frame (TCP); the lane and
    /// epoch of a shared-memory write gate (`kvmesh_kvxfer::shm::WriteKey`); an
    /// RDMA remote key. Revoking the grant invalidates it.
    pub write_key: u64,
    /// The granted pages in logical order, each with the generation it was
    /// granted at.
    pub pages: Vec<PageRef>,
    /// How to reach the pool, e.g. `tcp://127.0.0.1:7000` or `shm:/kvmesh-0`.
    pub endpoint: String,
}

impl Grant {
    /// Prompt slots in logical page `index` of the grant: `page_size`,
    /// except in the last page, which holds the rest. `None` past the page
    /// list.
    pub fn prompt_slots(&self, index: usize) -> Option<u32> {
        if index >= self.pages.len() {
            return None;
        }
        let page_size = u64::from(self.geometry.page_size);
        let before = (index as u64)
            .saturating_mul(page_size)
            .saturating_add(self.cached_tokens);
        let left = self.prompt_tokens.saturating_sub(before);
        u32::try_from(left.min(page_size)).ok()
    }

    /// Whether `frame` may be written into this grant's pages: same
    /// reservation, same capability (constant time), same geometry, a page
    /// index in the list whose physical page and generation match, slots
    /// within the prompt's slots in that page. Checks only the grant: the
    /// pool still checks the page's current generation and owner when it
    /// writes.
    pub fn check_frame(&self, frame: &KvFrame<'_>) -> Result<(), FrameReject> {
        if frame.reservation != self.reservation {
            return Err(FrameReject::UnknownReservation {
                got: frame.reservation,
            });
        }
        if !ct_eq(frame.capability.expose(), self.capability.expose()) {
            return Err(FrameReject::BadCapability {
                reservation: self.reservation,
            });
        }
        if frame.geometry != self.geometry {
            return Err(FrameReject::GeometryMismatch {
                expected: self.geometry,
                got: frame.geometry,
            });
        }
        let index = frame.page_index;
        let (granted, prompt_slots) = match (
            self.pages.get(index as usize),
            self.prompt_slots(index as usize),
        ) {
            (Some(p), Some(s)) => (*p, s),
            _ => {
                return Err(FrameReject::PageOutOfGrant {
                    index,
                    n_pages: self.pages.len(),
                })
            }
        };
        if frame.page.page != granted.page {
            return Err(FrameReject::WrongPage {
                index,
                expected: granted.page,
                got: frame.page.page,
            });
        }
        if frame.page.generation != granted.generation {
            return Err(FrameReject::StaleGeneration {
                page: granted.page,
                expected: granted.generation,
                got: frame.page.generation,
            });
        }
        if frame.slots.end > prompt_slots {
            return Err(FrameReject::SlotsOutOfPrompt {
                index,
                end: frame.slots.end,
                prompt_slots,
            });
        }
        Ok(())
    }

    /// Bytes this grant takes on the wire.
    pub fn encoded_len(&self) -> usize {
        HEADER_LEN + self.body_len() + TRAILER_LEN
    }

    fn body_len(&self) -> usize {
        GRANT_FIXED_LEN + self.pages.len().saturating_mul(PAGE_ENTRY_LEN) + self.endpoint.len()
    }

    /// Checks what the decoder checks.
    pub fn validate(&self) -> Result<(), WireError> {
        self.geometry.validate()?;
        check_page_count(
            &self.geometry,
            self.prompt_tokens,
            self.cached_tokens,
            self.pages.len(),
        )?;
        if self.endpoint.is_empty() {
            return Err(WireError::InvalidField {
                field: "endpoint",
                value: 0,
                reason: "empty",
            });
        }
        Ok(())
    }

    /// Appends the encoded grant to `out`; returns the bytes appended.
    /// Refused (nothing appended) if invalid, if the page list exceeds
    /// `u32::MAX` entries, or the endpoint 65,535 bytes.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<usize, WireError> {
        self.validate()?;
        let n_pages: u32 = fit(self.pages.len(), "pages")?;
        let endpoint_len: u16 = fit(self.endpoint.len(), "endpoint")?;
        seal(MessageType::Grant, self.body_len(), out, |o| {
            o.put_id(&self.reservation);
            o.put_capability(&self.capability);
            self.geometry.put(o);
            o.put_u64(self.prompt_tokens);
            o.put_u64(self.cached_tokens);
            o.put_u64(self.lease_deadline_unix_ms);
            o.put_u64(self.write_key);
            o.put_u32(n_pages);
            o.put_u16(endpoint_len);
            for p in &self.pages {
                o.put_u32(p.page);
                o.put_u64(p.generation);
            }
            o.extend_from_slice(self.endpoint.as_bytes());
        })
    }

    /// Decodes a grant body. The page list is allocated only after its
    /// declared length is checked against the bytes present.
    pub(crate) fn decode_body(body: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(body);
        let reservation = r.id("reservation")?;
        let capability = r.capability()?;
        let geometry = Geometry::read(&mut r)?;
        let prompt_tokens = r.u64("prompt_tokens")?;
        let cached_tokens = r.u64("cached_tokens")?;
        let lease_deadline_unix_ms = r.u64("lease_deadline_unix_ms")?;
        let write_key = r.u64("write_key")?;
        let n_pages = r.u32("pages")? as usize;
        let endpoint_len = usize::from(r.u16("endpoint")?);
        let declared = n_pages
            .checked_mul(PAGE_ENTRY_LEN)
            .and_then(|p| p.checked_add(endpoint_len));
        if declared != Some(r.remaining()) {
            return Err(WireError::LengthMismatch {
                field: "pages",
                declared: declared.map_or(u64::MAX, |d| d as u64),
                actual: r.remaining() as u64,
            });
        }
        // Everything is checked before anything is allocated: the count the
        // prompt implies, then the endpoint.
        check_page_count(&geometry, prompt_tokens, cached_tokens, n_pages)?;
        let list = r.take(n_pages * PAGE_ENTRY_LEN, "pages")?;
        let endpoint = r.take(endpoint_len, "endpoint")?;
        r.finish("grant")?;
        let endpoint = std::str::from_utf8(endpoint).map_err(|e| WireError::InvalidField {
            field: "endpoint",
            value: e.valid_up_to() as u64,
            reason: "not UTF-8 (value: bytes of valid prefix)",
        })?;
        if endpoint.is_empty() {
            return Err(WireError::InvalidField {
                field: "endpoint",
                value: 0,
                reason: "empty",
            });
        }
        let mut list = Reader::new(list);
        let mut pages = Vec::with_capacity(n_pages);
        for _ in 0..n_pages {
            pages.push(PageRef {
                page: list.u32("pages.page")?,
                generation: list.u64("pages.generation")?,
            });
        }
        let grant = Self {
            reservation,
            capability,
            geometry,
            prompt_tokens,
            cached_tokens,
            lease_deadline_unix_ms,
            write_key,
            pages,
            endpoint: endpoint.to_owned(),
        };
        grant.validate()?;
        Ok(grant)
    }
}

/// At least one prompt token, a cached head of whole pages shorter than
/// the prompt, and exactly `ceil((prompt_tokens - cached_tokens) /
/// page_size)` pages. `geometry` is valid (page_size >= 1).
fn check_page_count(
    geometry: &Geometry,
    prompt_tokens: u64,
    cached_tokens: u64,
    n_pages: usize,
) -> Result<(), WireError> {
    if prompt_tokens == 0 {
        return Err(WireError::InvalidField {
            field: "prompt_tokens",
            value: 0,
            reason: "a grant covers at least one token",
        });
    }
    let page_size = u64::from(geometry.page_size).max(1);
    if cached_tokens >= prompt_tokens || !cached_tokens.is_multiple_of(page_size) {
        return Err(WireError::InvalidField {
            field: "cached_tokens",
            value: cached_tokens,
            reason: "whole pages, fewer than the prompt's tokens",
        });
    }
    let needed = (prompt_tokens - cached_tokens).div_ceil(page_size);
    if n_pages as u64 != needed {
        return Err(WireError::LengthMismatch {
            field: "pages",
            declared: n_pages as u64,
            actual: needed,
        });
    }
    Ok(())
}
