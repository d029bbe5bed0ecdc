//! The UCX transport: the decode pool lives in a region registered with
//! UCX ([`kvmesh_ucx::Target`]); prefill writes into it through UCX, and
//! the receiver does not see page frames as the TCP transport does.
//! Control messages (and the mesh-secret handshake, and mutual TLS where
//! the mesh has certificates) stay on the TCP connection.
//!
//! Each grant's write key is a fresh random value that exactly one writer
//! endpoint binds (acknowledged before the first write). Revocation closes
//! that endpoint (force, peer error-handling mode) and is complete when
//! the close is: no write through it lands afterwards, in-flight ones
//! included. A writer reports transfer-done only after the endpoint's
//! drain succeeded (a write can report local success after a revocation).
//!
//! How the bytes travel is decided per endpoint once it is bound
//! ([`kvmesh_ucx::DataPath::Auto`]):
//! - **puts** (`ucp_put_nbx`, one-sided, drained by `ucp_ep_flush_nbx`)
//!   where the endpoint has a hardware RMA lane (RDMA on InfiniBand or
//!   RoCE): the NIC writes decode memory, no decode CPU is involved;
//! - **data messages** (eager active messages, drained by a fence round
//!   trip) where it has not (UCX's `tcp`): the target's progress thread
//!   copies each one into the region only while the endpoint is bound to
//!   the key and the bytes lie inside the key's grant's pages. UCX's software puts over
//!   `tcp` would cost the same copy, and they acknowledge each put from
//!   the target, where a failed acknowledgement (a writer killed with puts
//!   in flight) aborts the decode process inside UCX (1.13 and upstream:
//!   `ucp_rma_sw_send_cmpl` -> `ucp_request_try_send` fatal "unexpected
//!   error"; seen 1 in 30 kills before this path existed, 0 in 40 after).
//!
//! | handshake step (`protocol_model`) | UCX calls |
//! |---|---|
//! | grant opens a write path | `Target::open`: the key becomes bindable |
//! | writer takes up the grant | `ucp_ep_create` (client-server, peer error mode) to the listener; active message BIND(key) with reply-ep; the target binds the endpoint it created from the connection request (`ucp_ep_create` with the request) and answers BOUND; `ucp_ep_rkey_unpack`; `ucp_ep_print_info` shows whether a lane does RMA in hardware |
//! | one-sided write | `ucp_put_nbx` into the registered region (`ucp_mem_map`, `ucp_rkey_pack`) on RDMA; on `tcp`, `ucp_am_send_nbx` DATA(key, offset), landed by the target's handler |
//! | drain before transfer-done / abort-confirmed | `ucp_ep_flush_nbx` (puts) or FENCE/FENCED (messages, one lane, in order); success is the only proof of landing |
//! | revoke (transfer-done, abort, lease, connection lost) | the key leaves the target's data sink, then `ucp_ep_close_nbx(FORCE)` on the target's endpoint, completion awaited |
//! | writer death | the endpoint's error callback; the same close |
//!
//! The trust model is the shared-memory transport's, wider: the remote key
//! covers the whole pool, and UCX authenticates no one, so the UCX network
//! must be one only mesh nodes reach (see `docs/security.md`, "What UCX
//! does and does not protect").

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kvmesh_kernels::PageRef;
use kvmesh_kvpool::{KvPool, PoolConfig, PoolError, PoolMemory};
use kvmesh_kvwire::{DataPath, Geometry, Welcome};
use kvmesh_ucx::{Extents, Initiator, Remote, Revoke, Target, UcxError};

use crate::shm::PeerProcess;

use super::kind::{Control, ListenSettings, Outbound, Spec};
use super::{BoxFuture, Landing, PageWrite, Revocation, TransportError, WritePath};

/// The UCX row of the transport table.
pub(crate) const SPEC: Spec = Spec {
    name: "ucx",
    about: "One-sided UCX puts into the decode pool (RDMA where the fabric has it; UCX's tcp elsewhere); needs libucp (Debian's libucx0)",
    control: Control::Tcp,
    available,
    land,
    write_path,
};

/// Whether libucp loads in this process.
fn available() -> Result<(), TransportError> {
    kvmesh_ucx::load()?;
    Ok(())
}

/// The pool registered with UCX, its listener on `settings.ucx_listen`.
fn land(
    pool: PoolConfig,
    settings: &ListenSettings,
    node: &str,
) -> Result<(KvPool, Arc<dyn Landing>), TransportError> {
    let (pool, landing) = ucx_pool(pool, settings.ucx_listen)?;
    tracing::info!(
        node = %node,
        ucx_listener = %landing.target().address(),
        ucx = ?kvmesh_ucx::version().ok(),
        "decode node KV pool registered with UCX"
    );
    Ok((pool, landing))
}

/// UCX endpoints to the region the Welcome describes.
fn write_path(welcome: &Welcome, out: &Outbound<'_>) -> Result<Box<dyn WritePath>, TransportError> {
    Ok(Box::new(UcxWritePath::new(
        &welcome.data_path,
        welcome.geometry,
        out.peer,
    )?))
}

/// How long a revocation waits for the endpoint's close before it answers
/// `Pending` (the table then quarantines and asks again on its tick).
pub const REVOKE_WAIT: Duration = Duration::from_millis(50);
/// How long a writer waits for the target to acknowledge a bind.
pub const BIND_TIMEOUT: Duration = Duration::from_secs(5);

/// The pool's memory: the target's registered region.
#[derive(Debug)]
struct Region(Arc<Target>);

// SAFETY: the target's region is an anonymous mapping (zero-filled,
// page-aligned) of `len()` bytes that lives, unmoved, as long as the target,
// which this value keeps alive; kvmesh makes no references into it but
// through the pool. Remote writes into it are fenced per grant by
// `UcxLanding::revoke` (the module doc).
unsafe impl PoolMemory for Region {
    fn data_ptr(&self) -> NonNull<u8> {
        self.0.base()
    }

    fn len_bytes(&self) -> usize {
        self.0.len()
    }
}

/// A pool of `cfg` in a region registered with UCX, and its landing, whose
/// listener is on `listen` (port 0: any).
pub fn ucx_pool(
    cfg: PoolConfig,
    listen: SocketAddr,
) -> Result<(KvPool, Arc<UcxLanding>), TransportError> {
    cfg.validate().map_err(pool_error)?;
    // Validated: n_pages > 0 and the size fits.
    let page_bytes = cfg.bytes() / cfg.n_pages;
    let target = Arc::new(Target::start(listen, cfg.bytes())?);
    let memory: Arc<dyn PoolMemory> = Arc::new(Region(Arc::clone(&target)));
    let pool = KvPool::new_in(cfg, memory).map_err(pool_error)?;
    Ok((pool, Arc::new(UcxLanding { target, page_bytes })))
}

fn pool_error(e: PoolError) -> TransportError {
    TransportError::Protocol(format!("UCX pool: {e}"))
}

/// Decode side: keys, their endpoints, revocation by endpoint close.
#[derive(Debug)]
pub struct UcxLanding {
    target: Arc<Target>,
    /// Bytes of one page in the region (pages are page-major from 0).
    page_bytes: usize,
}

impl UcxLanding {
    /// The UCX target (listener address, counters).
    pub fn target(&self) -> &Arc<Target> {
        &self.target
    }
}

impl Landing for UcxLanding {
    fn data_path(&self) -> DataPath {
        DataPath::Ucx {
            address: self.target.address().to_string(),
            base: self.target.base().as_ptr() as u64,
            len: self.target.len() as u64,
            rkey: self.target.rkey().to_vec(),
        }
    }

    fn receiver_checked(&self) -> bool {
        false
    }

    fn open(&self, pages: &[PageRef]) -> Result<u64, TransportError> {
        // Unguessable, so that nobody who reaches the listener can bind a
        // grant's key before its writer does.
        let n = kvmesh_meshauth::kv::mint_nonce()?;
        let mut k = [0u8; 8];
        k.copy_from_slice(&n[..8]);
        let key = u64::from_le_bytes(k) | 1;
        // The key's data messages land in these pages only.
        let pb = self.page_bytes;
        let extents = Extents::new(pages.iter().map(|p| {
            let at = (p.page as usize).saturating_mul(pb);
            at..at.saturating_add(pb)
        }));
        self.target.open(key, extents)?;
        Ok(key)
    }

    fn refused(&self) -> Vec<(&'static str, u64)> {
        use std::sync::atomic::Ordering::Relaxed;
        let s = self.target.stats();
        vec![
            ("outside_grant", s.data_outside_grant.load(Relaxed)),
            // Endpoints closed at once: `MAX_UNBOUND` others had bound
            // no key yet.
            ("too_many_unbound", s.crowded.load(Relaxed)),
        ]
    }

    fn revoke(&self, key: u64, _writer: Option<&PeerProcess>) -> Revocation {
        // A dead writer's endpoint fails and is closed like any other: the
        // close is what completes the revocation, not the death.
        match self.target.revoke(key, REVOKE_WAIT) {
            Revoke::Complete => Revocation::Complete,
            Revoke::Pending => Revocation::Pending { active: 1 },
        }
    }
}

/// Prefill side: one UCX worker per connection, one endpoint per grant.
#[derive(Debug)]
pub struct UcxWritePath {
    initiator: Initiator,
    remote: Arc<Remote>,
    geometry: Geometry,
    bound: Mutex<HashSet<u64>>,
}

impl UcxWritePath {
    /// A write path to the region `Welcome` described; `peer` is the IP
    /// the writer dialled, used when the listener's IP is unspecified.
    pub fn new(
        path: &DataPath,
        geometry: Geometry,
        peer: Option<IpAddr>,
    ) -> Result<Self, TransportError> {
        let DataPath::Ucx {
            address,
            base,
            len,
            rkey,
        } = path
        else {
            return Err(TransportError::Protocol("not a UCX data path".into()));
        };
        let mut address: SocketAddr = address.parse().map_err(|_| TransportError::Endpoint {
            endpoint: address.clone(),
            reason: "the UCX listener is not IP:PORT",
        })?;
        if address.ip().is_unspecified() {
            if let Some(ip) = peer {
                address.set_ip(ip);
            }
        }
        let page = geometry.page_bytes().ok_or(TransportError::Protocol(
            "the pool geometry's page size overflows".into(),
        ))?;
        if page == 0 || *len % page != 0 {
            return Err(TransportError::Protocol(format!(
                "the UCX region ({len} bytes) is not whole pages of {page} bytes"
            )));
        }
        let initiator = Initiator::start()?;
        // Endpoints connect (milliseconds of wire-up) before the first
        // grant needs one.
        initiator.prepare(address);
        Ok(Self {
            initiator,
            remote: Arc::new(Remote {
                address,
                base: *base,
                len: *len,
                rkey: rkey.clone(),
            }),
            geometry,
            bound: Mutex::default(),
        })
    }

    /// Byte offsets in the region of slot `slot` of `layer` of `page`: K,
    /// then V (the pool's layout: page-major, per layer a K block of
    /// `page_size` slots, then a V block unless entries are latent).
    fn offsets(&self, page: u32, layer: u16, slot: u32) -> Option<(u64, u64)> {
        let g = &self.geometry;
        let slot_bytes = g.kv_dim().checked_mul(g.dtype.size())?;
        let block = slot_bytes.checked_mul(u64::from(g.page_size))?;
        let k = u64::from(page)
            .checked_mul(g.page_bytes()?)?
            .checked_add(
                u64::from(layer)
                    .checked_mul(g.blocks())?
                    .checked_mul(block)?,
            )?
            .checked_add(u64::from(slot).checked_mul(slot_bytes)?)?;
        Some((k, k.checked_add(block)?))
    }
}

impl WritePath for UcxWritePath {
    fn write<'a>(&'a self, w: PageWrite<'a>) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            let key = w.grant.write_key;
            let page = w
                .grant
                .pages
                .get(w.index as usize)
                .ok_or(TransportError::Protocol(format!(
                    "page index {} outside the grant",
                    w.index
                )))?;
            let (k_at, v_at) = self
                .offsets(page.page, w.layer, w.slots.start)
                .ok_or(TransportError::Protocol("write offset overflows".into()))?;
            let fresh = !self
                .bound
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .contains(&key);
            if fresh {
                self.initiator
                    .bind(key, Arc::clone(&self.remote), BIND_TIMEOUT)
                    .await?;
                self.bound
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(key);
            }
            if w.slots.len() as u64 == u64::from(self.geometry.page_size)
                && k_at + w.k.len() as u64 == v_at
            {
                // A whole page's layer: its K and V blocks are adjacent,
                // one put.
                let mut kv = Vec::with_capacity(w.k.len() + w.v.len());
                kv.extend_from_slice(w.k);
                kv.extend_from_slice(w.v);
                self.initiator.put(key, k_at, kv).await?;
            } else {
                self.initiator.put(key, k_at, w.k.to_vec()).await?;
                if !w.v.is_empty() {
                    self.initiator.put(key, v_at, w.v.to_vec()).await?;
                }
            }
            Ok(())
        })
    }

    fn drain(&self) -> BoxFuture<'_, Result<(), TransportError>> {
        // Every grant's endpoint: flushed, or failed (closed by the
        // target: nothing of it can land any more).
        Box::pin(async move {
            let keys: Vec<u64> = self
                .bound
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .iter()
                .copied()
                .collect();
            for key in keys {
                match self.initiator.flush(key).await {
                    Ok(()) | Err(UcxError::Closed(_) | UcxError::NotBound(_)) => {}
                    Err(UcxError::Stopped) => return Err(UcxError::Stopped.into()),
                    Err(_) => {}
                }
            }
            Ok(())
        })
    }

    fn drain_grant(&self, write_key: u64) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(async move {
            let bound = self
                .bound
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .contains(&write_key);
            if !bound {
                // Nothing was written (an empty grant): nothing to flush.
                return Ok(());
            }
            self.initiator.flush(write_key).await?;
            Ok(())
        })
    }

    fn release(&self, write_key: u64) {
        let was = self
            .bound
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&write_key);
        if was {
            self.initiator.release(write_key);
        }
    }
}
