//! The same client for synchronous callers (the end-to-end tests): each
//! call runs on a current-thread runtime of its own, bounded by
//! [`TIMEOUT`]; a [`Streaming`] response owns the runtime its connection
//! lives on, so the connection makes progress only while its events are
//! read, and dropping it closes the socket.
//!
//! Called from inside a tokio runtime (a `#[tokio::test]`), a call runs on
//! a scoped thread of its own, since a runtime can neither block on nor
//! drop another.

use std::future::Future;
use std::time::Duration;

use tokio::runtime::Runtime;

use crate::http::{self, Error, Reply, Request, SseReader};
use crate::metrics::{self, Metrics};

/// How long one blocking call (a whole response, or the next event of a
/// stream) may take.
pub const TIMEOUT: Duration = Duration::from_secs(120);

fn runtime() -> Result<Runtime, Error> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(Error::Runtime)
}

/// Runs `f` here, or on a scoped thread when this thread is inside a
/// tokio runtime (which may neither block on nor drop another runtime).
fn off_runtime<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    if tokio::runtime::Handle::try_current().is_ok() {
        std::thread::scope(|s| {
            s.spawn(f)
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p))
        })
    } else {
        f()
    }
}

/// Runs `f` on `rt` within [`TIMEOUT`]; called off any runtime.
fn block<F, T>(rt: &Runtime, f: F) -> Result<T, Error>
where
    F: Future<Output = Result<T, Error>>,
{
    rt.block_on(async { tokio::time::timeout(TIMEOUT, f).await })
        .map_err(|_| Error::Timeout(TIMEOUT))?
}

/// Sends `req` to `addr` and reads the whole response.
pub fn request(addr: &str, req: &Request) -> Result<Reply, Error> {
    off_runtime(|| block(&runtime()?, http::request(addr, req)))
}

/// `GET path`.
pub fn get(addr: &str, path: &str) -> Result<Reply, Error> {
    request(addr, &Request::get(path))
}

/// Scrapes `http://ADDR/metrics` (see [`metrics::scrape`]).
pub fn scrape(addr: &str) -> Result<Metrics, metrics::ScrapeError> {
    off_runtime(|| {
        let rt = runtime()?;
        let scraped = async { Ok(metrics::scrape(addr).await) };
        block(&rt, scraped)?
    })
}

/// Sends `req` to `addr` and returns the response open, to read its
/// server-sent events one by one.
pub fn stream(addr: &str, req: &Request) -> Result<Streaming, Error> {
    off_runtime(|| {
        let rt = runtime()?;
        let open = block(&rt, http::send(addr, req))?;
        Ok(Streaming {
            status: open.status,
            headers: open.headers.clone(),
            events: Some(open.events()),
            rt: Some(rt),
        })
    })
}

/// An open response read as server-sent events.
#[derive(Debug)]
pub struct Streaming {
    /// The status code.
    pub status: u16,
    /// Header names (lower case) and values, in order.
    pub headers: Vec<(String, String)>,
    // Declared before `rt`: the body and connection go first.
    events: Option<SseReader>,
    // `None` only once dropped.
    rt: Option<Runtime>,
}

impl Streaming {
    /// The next event's data, or `Ok(None)` once the stream ended (and on
    /// every call after an error).
    pub fn next_event(&mut self) -> Result<Option<String>, Error> {
        let (Some(events), Some(rt)) = (self.events.as_mut(), self.rt.as_ref()) else {
            return Ok(None);
        };
        let next = off_runtime(|| block(rt, events.next()));
        if !matches!(next, Ok(Some(_))) {
            // Ended or failed: close the connection now.
            self.events = None;
        }
        next
    }
}

impl Drop for Streaming {
    fn drop(&mut self) {
        // The body and connection first; then the runtime, without
        // blocking, so a stream may be dropped inside another runtime.
        self.events = None;
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}
