//! The TCP transport: frames travel on the connection and the receiver
//! checks each one against its grant before it lands, so a frame that
//! arrives after an abort, a revocation or a release is refused on arrival.

use std::sync::Arc;

use tokio::sync::mpsc;

use crate::shm::PeerProcess;
use kvmesh_kvpool::{KvPool, PoolConfig};
use kvmesh_kvwire::{DataPath, KvFrame, Welcome};

use super::kind::{always, Control, ListenSettings, Outbound, Spec};
use super::{BoxFuture, Landing, PageWrite, Revocation, TransportError, WritePath};

/// The TCP row of the transport table.
pub(crate) const SPEC: Spec = Spec {
    name: "tcp",
    about: "KV frames over TCP, checked by the receiver before they land",
    control: Control::Tcp,
    available: always,
    land,
    write_path,
};

/// A heap pool: frames land through the table, nothing else reaches it.
fn land(
    pool: PoolConfig,
    _: &ListenSettings,
    _node: &str,
) -> Result<(KvPool, Arc<dyn Landing>), TransportError> {
    Ok((KvPool::new(pool)?, Arc::new(TcpLanding)))
}

/// Frames on the connection's own outbound queue.
fn write_path(_: &Welcome, out: &Outbound<'_>) -> Result<Box<dyn WritePath>, TransportError> {
    Ok(Box::new(TcpWritePath::new(out.tx.clone())))
}

/// Decode side: frames land through the reservation table, which refuses
/// every frame of a reservation that is not granted or writing. Revocation
/// is a phase change under the reservation's entry lock, so it is complete
/// as soon as it is made: no frame is landing meanwhile, none lands later.
#[derive(Debug, Default)]
pub struct TcpLanding;

impl Landing for TcpLanding {
    fn data_path(&self) -> DataPath {
        DataPath::Frames
    }

    fn receiver_checked(&self) -> bool {
        true
    }

    /// Frames are checked against the grant's pages on arrival
    /// (`Grant::check_frame`), so the key is unused.
    fn open(&self, _pages: &[kvmesh_kernels::PageRef]) -> Result<u64, TransportError> {
        Ok(0)
    }

    fn revoke(&self, _key: u64, _writer: Option<&PeerProcess>) -> Revocation {
        Revocation::Complete
    }
}

/// Prefill side: each write becomes one [`KvFrame`] queued on the
/// connection, in order with every control message sent after it.
#[derive(Debug)]
pub struct TcpWritePath {
    tx: mpsc::Sender<Vec<u8>>,
}

impl TcpWritePath {
    /// A write path onto the connection whose outbound queue is `tx`.
    pub fn new(tx: mpsc::Sender<Vec<u8>>) -> Self {
        Self { tx }
    }
}

impl WritePath for TcpWritePath {
    fn write<'a>(&'a self, w: PageWrite<'a>) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            let g = w.grant;
            let page = *g
                .pages
                .get(w.index as usize)
                .ok_or(TransportError::Protocol(format!(
                    "page index {} outside the grant",
                    w.index
                )))?;
            let mut payload = Vec::with_capacity(w.k.len() + w.v.len());
            payload.extend_from_slice(w.k);
            payload.extend_from_slice(w.v);
            let frame = KvFrame {
                reservation: g.reservation,
                capability: g.capability.clone(),
                page_index: w.index,
                page,
                geometry: g.geometry,
                layers: w.layer..w.layer.saturating_add(1),
                slots: w.slots.clone(),
                payload: &payload,
            };
            let mut bytes = Vec::with_capacity(frame.encoded_len());
            frame.encode(&mut bytes)?;
            self.tx
                .send(bytes)
                .await
                .map_err(|_| TransportError::Closed)
        })
    }

    fn drain(&self) -> BoxFuture<'_, Result<(), TransportError>> {
        // Frames and control messages share one ordered queue and stream:
        // whatever is sent after this is behind every frame sent before.
        Box::pin(async { Ok(()) })
    }
}
