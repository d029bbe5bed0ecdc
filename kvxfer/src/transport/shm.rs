//! The shared-memory transport: the decode pool lives in a mapping
//! ([`crate::shm::ShmRegion`]) that the prefill process writes one-sided,
//! the way RDMA writes land; the receiver cannot check a write before it
//! lands. Each grant gets a lane (write gate); revocation closes the lane
//! and completes once no write through it is active, or once the writer's
//! process is dead (its writes cannot land any more).

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};

use crate::shm::{LaneClose, PeerProcess, ShmRegion, WriteKey};
use kvmesh_kernels::PageRef;
use kvmesh_kvpool::{KvPool, PoolConfig};
use kvmesh_kvwire::{DataPath, Welcome};

use super::kind::{always, Control, ListenSettings, Outbound, Spec};
use super::{BoxFuture, Landing, PageWrite, Revocation, TransportError, WritePath};

/// The shared-memory row of the transport table.
pub(crate) const SPEC: Spec = Spec {
    name: "shm",
    about: "One-sided writes into the decode pool's shared-memory mapping",
    control: Control::Unix,
    available: always,
    land,
    write_path,
};

/// The pool in a fresh mapping in `settings.shm_dir`, its lanes the
/// landing.
fn land(
    pool: PoolConfig,
    settings: &ListenSettings,
    _node: &str,
) -> Result<(KvPool, Arc<dyn Landing>), TransportError> {
    let (pool, region) = crate::shm::shared_pool(pool, &settings.shm_dir)?;
    Ok((pool, Arc::new(ShmLanding::new(region))))
}

/// Maps the file the Welcome names, once its layout is the pool geometry
/// the Welcome states.
fn write_path(welcome: &Welcome, _: &Outbound<'_>) -> Result<Box<dyn WritePath>, TransportError> {
    let DataPath::SharedMemory { path } = &welcome.data_path else {
        return Err(TransportError::Protocol(
            "not a shared-memory data path".into(),
        ));
    };
    let region = ShmRegion::open(std::path::Path::new(path), None)?;
    let l = region.layout();
    let g = welcome.geometry;
    let same = l.page_size == g.page_size
        && l.n_layers == u32::from(g.n_layers)
        && l.n_kv_heads == u32::from(g.n_kv_heads)
        && l.head_dim == u32::from(g.head_dim)
        && l.entry == g.entry;
    if !same {
        return Err(TransportError::Protocol(format!(
            "the mapping's layout {l:?} is not the pool geometry {g:?}"
        )));
    }
    Ok(Box::new(ShmWritePath::new(region)))
}

/// Decode side: hands out lanes, closes them.
#[derive(Debug)]
pub struct ShmLanding {
    region: Arc<ShmRegion>,
    lanes: Mutex<Lanes>,
}

#[derive(Debug)]
struct Lanes {
    free: Vec<u32>,
    /// Lanes handed to grants and not yet drained: a lane goes back to
    /// `free` once, however often its revocation is reported.
    out: HashSet<u32>,
}

impl ShmLanding {
    /// Lanes of `region`, all free.
    pub fn new(region: Arc<ShmRegion>) -> Self {
        let n = u32::try_from(region.layout().n_lanes).unwrap_or(u32::MAX);
        Self {
            region,
            lanes: Mutex::new(Lanes {
                free: (0..n).rev().collect(),
                out: HashSet::new(),
            }),
        }
    }

    /// The mapping.
    pub fn region(&self) -> &Arc<ShmRegion> {
        &self.region
    }

    /// Lanes free now.
    pub fn free_lanes(&self) -> usize {
        self.lock().free.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Lanes> {
        self.lanes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn give_back(&self, lane: u32) {
        let mut l = self.lock();
        if l.out.remove(&lane) {
            l.free.push(lane);
        }
    }
}

impl Landing for ShmLanding {
    fn data_path(&self) -> DataPath {
        DataPath::SharedMemory {
            path: self.region.path().display().to_string(),
        }
    }

    fn receiver_checked(&self) -> bool {
        false
    }

    fn open(&self, pages: &[PageRef]) -> Result<u64, TransportError> {
        let pages: Vec<u32> = pages.iter().map(|p| p.page).collect();
        let lane = {
            let mut l = self.lock();
            let lane = l.free.pop().ok_or(TransportError::NoLane)?;
            l.out.insert(lane);
            lane
        };
        match self.region.lane_open(lane, &pages) {
            Ok(key) => Ok(key.to_u64()),
            Err(e) => {
                self.give_back(lane);
                Err(e.into())
            }
        }
    }

    fn refused(&self) -> Vec<(&'static str, u64)> {
        vec![("outside_grant", self.region.refused_outside_grant())]
    }

    fn revoke(&self, key: u64, writer: Option<&PeerProcess>) -> Revocation {
        let key = WriteKey::from_u64(key);
        match self.region.lane_close(key) {
            Ok(LaneClose::Drained) => {
                self.give_back(key.lane);
                Revocation::Complete
            }
            Ok(LaneClose::Busy { active }) => {
                if writer.is_some_and(PeerProcess::has_exited)
                    && self.region.lane_force_reset(key.lane).is_ok()
                {
                    self.give_back(key.lane);
                    Revocation::Complete
                } else {
                    Revocation::Pending { active }
                }
            }
            // A key of no lane of this region: nothing can write through
            // it.
            Err(_) => Revocation::Complete,
        }
    }
}

/// Prefill side: copies straight into the decode pool's mapping, through
/// the grant's lane.
#[derive(Debug)]
pub struct ShmWritePath {
    region: Arc<ShmRegion>,
}

impl ShmWritePath {
    /// A write path into `region` (mapped from the path in `Welcome`).
    pub fn new(region: Arc<ShmRegion>) -> Self {
        Self { region }
    }
}

impl WritePath for ShmWritePath {
    fn write<'a>(&'a self, w: PageWrite<'a>) -> BoxFuture<'a, Result<(), TransportError>> {
        let r = (|| {
            let page = w
                .grant
                .pages
                .get(w.index as usize)
                .ok_or(TransportError::Protocol(format!(
                    "page index {} outside the grant",
                    w.index
                )))?;
            self.region.write_slots(
                WriteKey::from_u64(w.grant.write_key),
                page.page,
                u32::from(w.layer),
                w.slots.start,
                w.k,
                w.v,
            )?;
            Ok(())
        })();
        Box::pin(async move { r })
    }

    fn drain(&self) -> BoxFuture<'_, Result<(), TransportError>> {
        // Copies finish before `write` returns.
        Box::pin(async { Ok(()) })
    }
}
