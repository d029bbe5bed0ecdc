//! The progress thread: an actor that owns a role's [`Core`] and runs the
//! jobs its handle sends, waking on the worker's events or a job.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::event::{eventfd, poll, EventfdFlags, PollFd, PollFlags, Timespec};
use tokio::sync::{mpsc, oneshot};

use crate::core::{Core, Event};
use crate::error::UcxError;

/// A job for the actor.
pub(crate) type Job<S> = Box<dyn FnOnce(&mut S) + Send>;

/// A role's state on its progress thread.
pub(crate) trait Actor: 'static {
    fn core(&self) -> &Core;
    /// Handles what callbacks recorded.
    fn handle(&mut self, events: Vec<Event>);
    /// Timers (about every [`IDLE`]).
    fn housekeeping(&mut self, _now: Instant) {}
    /// Releases endpoints and registrations; returns once nothing is in
    /// flight, or after the deadline.
    fn shutdown(&mut self);
}

/// How long the thread sleeps with nothing to do.
const IDLE: Duration = Duration::from_millis(100);
/// Jobs queued at most.
const JOBS: usize = 1024;

/// The caller's handle on a progress thread. Dropping it stops the thread
/// (after the role's shutdown) and joins it.
pub(crate) struct Runner<S> {
    jobs: Option<mpsc::Sender<Job<S>>>,
    wake: Arc<Wake>,
    thread: Option<JoinHandle<()>>,
}

/// How callers wake the thread: an eventfd, written only while the thread
/// is parked (about to sleep, or asleep), so a busy stream of jobs costs
/// no system call per job.
struct Wake {
    fd: OwnedFd,
    parked: AtomicBool,
}

impl Wake {
    fn wake(&self) {
        // Pairs with the fence in `run`: either this sees the thread
        // parked, or the thread sees the job queued before it.
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.parked.swap(false, Ordering::SeqCst) {
            let _ = rustix::io::write(&self.fd, &1u64.to_ne_bytes());
        }
    }
}

impl<S: Actor> Runner<S> {
    /// Starts a thread named `name` whose state `make` builds there.
    pub(crate) fn spawn<F>(name: &str, make: F) -> Result<Self, UcxError>
    where
        F: FnOnce() -> Result<S, UcxError> + Send + 'static,
    {
        let wake = Arc::new(Wake {
            fd: eventfd(0, EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC)
                .map_err(|e| UcxError::os("eventfd", e))?,
            parked: AtomicBool::new(false),
        });
        let (tx, rx) = mpsc::channel::<Job<S>>(JOBS);
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
        let w = Arc::clone(&wake);
        let thread = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || match make() {
                Ok(state) => {
                    let _ = ready_tx.send(Ok(()));
                    run(state, rx, &w);
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            })
            .map_err(|e| UcxError::os("spawn the UCX progress thread", e))?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(Self {
                jobs: Some(tx),
                wake,
                thread: Some(thread),
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                let _ = thread.join();
                Err(UcxError::Stopped)
            }
        }
    }

    fn wake(&self) {
        self.wake.wake();
    }

    /// Queues a job without waiting; refused if the queue is full or the
    /// thread is gone.
    pub(crate) fn try_submit(&self, job: Job<S>) -> Result<(), UcxError> {
        let tx = self.jobs.as_ref().ok_or(UcxError::Stopped)?;
        tx.try_send(job).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => UcxError::Timeout("UCX job queue full"),
            mpsc::error::TrySendError::Closed(_) => UcxError::Stopped,
        })?;
        self.wake();
        Ok(())
    }

    /// Queues a job, waiting for room.
    pub(crate) async fn submit(&self, job: Job<S>) -> Result<(), UcxError> {
        let tx = self.jobs.as_ref().ok_or(UcxError::Stopped)?;
        tx.send(job).await.map_err(|_| UcxError::Stopped)?;
        self.wake();
        Ok(())
    }

    /// Runs `f` on the thread and returns its answer.
    pub(crate) async fn call<T, F>(&self, f: F) -> Result<T, UcxError>
    where
        T: Send + 'static,
        F: FnOnce(&mut S) -> T + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        self.submit(Box::new(move |s| {
            let _ = tx.send(f(s));
        }))
        .await?;
        rx.await.map_err(|_| UcxError::Stopped)
    }
}

impl<S> Drop for Runner<S> {
    fn drop(&mut self) {
        self.jobs = None;
        let _ = rustix::io::write(&self.wake.fd, &1u64.to_ne_bytes());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run<S: Actor>(mut s: S, mut rx: mpsc::Receiver<Job<S>>, wake: &Wake) {
    let mut last_tick = Instant::now();
    loop {
        let mut closed = false;
        for _ in 0..JOBS {
            match rx.try_recv() {
                Ok(job) => job(&mut s),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    closed = true;
                    break;
                }
            }
        }
        let events = s.core().progress();
        let busy = !events.is_empty();
        if busy {
            s.handle(events);
        }
        let now = Instant::now();
        if now.duration_since(last_tick) >= IDLE {
            s.housekeeping(now);
            last_tick = now;
        }
        if closed {
            s.shutdown();
            return;
        }
        if busy || !rx.is_empty() {
            continue;
        }
        // Parked from here: a job queued after this is announced on the
        // eventfd (the check below catches one queued just before).
        wake.parked.store(true, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        if !rx.is_empty() || !s.core().arm() {
            wake.parked.store(false, Ordering::SeqCst);
            continue;
        }
        let mut fds = [
            PollFd::from_borrowed_fd(s.core().efd(), PollFlags::IN),
            PollFd::from_borrowed_fd(wake.fd.as_fd(), PollFlags::IN),
        ];
        let timeout = Timespec {
            tv_sec: 0,
            tv_nsec: IDLE.as_nanos() as i64,
        };
        let _ = poll(&mut fds, Some(&timeout));
        wake.parked.store(false, Ordering::SeqCst);
        let mut buf = [0u8; 8];
        let _ = rustix::io::read(&wake.fd, &mut buf);
    }
}
