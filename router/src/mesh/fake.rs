//! A scripted [`Mesh`] for the gateway's unit tests: each request takes the
//! next [`Script`] (a refusal before dispatch, or events to play, with
//! gates the test opens), and the fake records the [`Job`] it received and
//! whether the gateway dropped the stream before the script ended. No node,
//! no network.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{mpsc, watch, Notify};

use super::{Admitted, Event, Job, Mesh};
use crate::error::Rejection;
use crate::membership::Discovery;
use crate::{Router, RouterConfig};

/// One request's part.
#[derive(Debug)]
pub(crate) enum Script {
    /// Refused before dispatch.
    Refuse(Rejection),
    /// These steps, then the stream closes.
    Play(Vec<Step>),
}

/// One step of a played script.
#[derive(Debug)]
pub(crate) enum Step {
    /// Send this event.
    Send(Event),
    /// Wait until the test notifies (or the gateway drops the stream).
    Gate(Arc<Notify>),
}

/// The scripted mesh.
#[derive(Debug)]
pub(crate) struct FakeMesh {
    capacity: Mutex<Option<usize>>,
    scripts: Mutex<VecDeque<Script>>,
    received: Mutex<Vec<Job>>,
    /// Requests whose stream the gateway dropped before the script ended.
    abandoned: Arc<AtomicUsize>,
    /// Requests still holding their slot.
    running: Arc<AtomicUsize>,
    /// Signalled when a request's task ends.
    ended: Arc<Notify>,
    /// What [`Mesh::discovery`] reports.
    discovery: watch::Sender<Discovery>,
}

impl FakeMesh {
    /// A mesh that can take `capacity` tokens per sequence, with no script.
    pub(crate) fn new(capacity: Option<usize>) -> Arc<Self> {
        Arc::new(Self {
            capacity: Mutex::new(capacity),
            scripts: Mutex::default(),
            received: Mutex::default(),
            abandoned: Arc::default(),
            running: Arc::default(),
            ended: Arc::default(),
            discovery: watch::channel(Discovery::Static).0,
        })
    }

    /// Sets what [`Mesh::discovery`] reports.
    pub(crate) fn set_discovery(&self, d: Discovery) {
        self.discovery.send_replace(d);
    }

    /// The next request's script.
    pub(crate) fn push(&self, s: Script) {
        lock(&self.scripts).push_back(s);
    }

    /// The next request plays `events`.
    pub(crate) fn play(&self, events: Vec<Event>) {
        self.push(Script::Play(events.into_iter().map(Step::Send).collect()));
    }

    /// Sets what [`Mesh::capacity`] answers.
    pub(crate) fn set_capacity(&self, c: Option<usize>) {
        *lock(&self.capacity) = c;
    }

    /// The jobs received so far.
    pub(crate) fn received(&self) -> Vec<Job> {
        lock(&self.received).clone()
    }

    /// Streams the gateway dropped before their script ended.
    pub(crate) fn abandoned(&self) -> usize {
        self.abandoned.load(Ordering::SeqCst)
    }

    /// Requests still holding their slot.
    pub(crate) fn running(&self) -> usize {
        self.running.load(Ordering::SeqCst)
    }

    /// Waits until no request holds a slot.
    pub(crate) async fn idle(&self) {
        loop {
            let ended = self.ended.notified();
            if self.running() == 0 {
                return;
            }
            ended.await;
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Mesh for FakeMesh {
    fn capacity(&self) -> Option<usize> {
        *lock(&self.capacity)
    }

    fn discovery(&self) -> watch::Receiver<Discovery> {
        self.discovery.subscribe()
    }

    fn generate(&self, req: Admitted) -> Result<mpsc::Receiver<Event>, Rejection> {
        let (job, slot) = req.into_parts();
        lock(&self.received).push(job);
        let script = lock(&self.scripts)
            .pop_front()
            .expect("the test scripted this request");
        let steps = match script {
            Script::Refuse(r) => return Err(r),
            Script::Play(steps) => steps,
        };
        let (tx, rx) = mpsc::channel(4);
        let (abandoned, running, ended) = (
            Arc::clone(&self.abandoned),
            Arc::clone(&self.running),
            Arc::clone(&self.ended),
        );
        running.fetch_add(1, Ordering::SeqCst);
        tokio::spawn(async move {
            let gone = async {
                for step in steps {
                    match step {
                        Step::Send(ev) => {
                            if tx.send(ev).await.is_err() {
                                return true;
                            }
                        }
                        Step::Gate(n) => tokio::select! {
                            () = n.notified() => {}
                            () = tx.closed() => return true,
                        },
                    }
                }
                false
            }
            .await;
            if gone {
                abandoned.fetch_add(1, Ordering::SeqCst);
            }
            drop(slot);
            running.fetch_sub(1, Ordering::SeqCst);
            ended.notify_waiters();
        });
        Ok(rx)
    }

    fn render_metrics(&self, out: &mut String) {
        out.push_str("# fake mesh\n");
        out.push_str(&format!(
            "kvmesh_fake_requests_received {}\n",
            lock(&self.received).len()
        ));
    }
}

/// The committed tiny model's tokenizer.
pub(crate) fn tiny_tokenizer() -> kvmesh_tokenizer::TextTokenizer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/data/tiny-llama");
    kvmesh_tokenizer::TextTokenizer::from_hf_dir(&dir).expect("tiny tokenizer")
}

/// A router over `mesh` with the tiny tokenizer, model `tiny-llama`,
/// a 256-token window, and `cfg`'s other settings.
pub(crate) fn router(mesh: &Arc<FakeMesh>, cfg: RouterConfig) -> Router {
    let cfg = RouterConfig {
        model_id: "tiny-llama".into(),
        max_model_len: 256,
        ..cfg
    };
    Router::with_mesh(cfg, tiny_tokenizer(), Arc::clone(mesh) as Arc<dyn Mesh>)
}
