//! Messages on a byte stream: each is self-delimiting (the header gives
//! its length), so a reader reads the header, checks it, then reads
//! exactly the rest, a bounded amount.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

use kvmesh_kvwire::{peek_header, DecodeLimits, WireError, HEADER_LEN};

use super::TransportError;

/// Reads one whole message into `buf` (replacing its contents). `Ok(false)`
/// on a clean end of stream before a header. A header the reader cannot
/// trust (bad magic, version, size) is an error: the stream cannot be
/// resynchronised, so the connection must end.
pub(crate) async fn read_message<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<u8>,
    limits: &DecodeLimits,
) -> Result<bool, TransportError> {
    buf.clear();
    buf.resize(HEADER_LEN, 0);
    let mut got = 0;
    while got < HEADER_LEN {
        let n = r
            .read(&mut buf[got..])
            .await
            .map_err(|source| TransportError::Io {
                op: "read header",
                source,
            })?;
        if n == 0 {
            if got == 0 {
                return Ok(false);
            }
            return Err(TransportError::Wire(WireError::Truncated {
                needed: HEADER_LEN,
                got,
            }));
        }
        got += n;
    }
    let header = peek_header(buf, limits)?;
    let len = header.message_len();
    buf.resize(len, 0);
    r.read_exact(&mut buf[HEADER_LEN..])
        .await
        .map_err(|source| TransportError::Io {
            op: "read message",
            source,
        })?;
    Ok(true)
}

/// Writes every message from `rx` to `w` until the channel closes or a
/// write fails; then shuts the write side down.
pub(crate) async fn pump<W: AsyncWrite + Unpin>(w: W, mut rx: mpsc::Receiver<Vec<u8>>) {
    // Queued messages go out in as few syscalls as the buffer allows.
    let mut w = tokio::io::BufWriter::with_capacity(1 << 18, w);
    while let Some(bytes) = rx.recv().await {
        if w.write_all(&bytes).await.is_err() {
            return;
        }
        // Batch what is queued already into the same flush.
        while let Ok(more) = rx.try_recv() {
            if w.write_all(&more).await.is_err() {
                return;
            }
        }
        if w.flush().await.is_err() {
            return;
        }
    }
    let _ = w.shutdown().await;
}
