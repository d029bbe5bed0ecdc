//! Following the mesh's prefix: get it, watch it from that revision, and
//! start over after any failure, publishing each change as one [`View`].

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{GetOptions, WatchOptions};
use tokio::sync::watch;

use crate::{bounded, connect, sleep_or_stop, DiscoveryError, EtcdConfig, Member};

/// First wait before trying etcd again; doubled up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
/// Longest wait between tries.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// Whether the view is current.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Health {
    /// No answer from etcd yet (the view is empty).
    Connecting,
    /// Following etcd: the view is current.
    Live,
    /// etcd cannot be reached (or the watch broke) since `since`: the view
    /// is the last one seen, and the watcher keeps trying.
    Degraded {
        /// When the watcher lost etcd.
        since: Instant,
        /// The last failure.
        reason: String,
    },
}

/// The members of the mesh as the watcher last saw them.
#[derive(Clone, Debug)]
pub struct View {
    /// By key.
    pub members: Arc<BTreeMap<String, Member>>,
    /// Whether it is current.
    pub health: Health,
    /// Entries under the prefix refused so far (not registrations, or not
    /// valid ones; each is logged).
    pub refused: u64,
}

impl View {
    fn empty() -> Self {
        Self {
            members: Arc::default(),
            health: Health::Connecting,
            refused: 0,
        }
    }

    /// The members.
    pub fn members(&self) -> impl Iterator<Item = &Member> {
        self.members.values()
    }
}

/// Follows one mesh's prefix in a task of its own until stopped.
#[derive(Debug)]
pub struct Watcher {
    views: watch::Receiver<View>,
    stop: watch::Sender<bool>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Watcher {
    /// Starts following `cfg.prefix`. Never fails: an unreachable etcd
    /// shows as [`Health::Degraded`] (or [`Health::Connecting`] at first).
    pub fn spawn(cfg: EtcdConfig) -> Self {
        let (tx, views) = watch::channel(View::empty());
        let (stop, stop_rx) = watch::channel(false);
        let task = Some(tokio::spawn(follow(cfg, tx, stop_rx)));
        Self { views, stop, task }
    }

    /// A receiver of every new view (the latest one only: a slow reader
    /// skips intermediate views, never falls behind).
    pub fn views(&self) -> watch::Receiver<View> {
        self.views.clone()
    }

    /// The first view that is not [`Health::Connecting`] (current or
    /// degraded), waiting at most `within`.
    pub async fn first(&self, within: Duration) -> View {
        let mut rx = self.views.clone();
        let _ = tokio::time::timeout(within, rx.wait_for(|v| v.health != Health::Connecting)).await;
        let v = rx.borrow().clone();
        v
    }

    /// Stops the task and waits for it.
    pub async fn stop(mut self) {
        self.stop.send_replace(true);
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.stop.send_replace(true);
    }
}

/// The watcher's state between reconnections.
struct State {
    cfg: EtcdConfig,
    members: BTreeMap<String, Member>,
    health: Health,
    refused: u64,
    tx: watch::Sender<View>,
}

impl State {
    fn publish(&self) {
        self.tx.send_replace(View {
            members: Arc::new(self.members.clone()),
            health: self.health.clone(),
            refused: self.refused,
        });
    }

    /// Applies one entry; a refused one is logged, counted, and removed
    /// from the view if it was there (a member whose entry became invalid
    /// is not kept on its old value).
    fn put(&mut self, key: &[u8], value: &[u8]) {
        match Member::decode(&self.cfg.prefix, key, value) {
            Ok(m) => {
                let key = String::from_utf8_lossy(key).into_owned();
                if self.members.get(&key) != Some(&m) {
                    tracing::info!(node = %m.name, role = m.role.as_str(), grpc = %m.grpc, "etcd: member registered");
                }
                self.members.insert(key, m);
            }
            Err(e) => {
                self.refused += 1;
                tracing::warn!(error = %e, "etcd: entry under the mesh prefix refused");
                self.members.remove(String::from_utf8_lossy(key).as_ref());
            }
        }
    }

    fn delete(&mut self, key: &[u8]) {
        if let Some(m) = self.members.remove(String::from_utf8_lossy(key).as_ref()) {
            tracing::info!(node = %m.name, role = m.role.as_str(), "etcd: member left");
        }
    }

    fn degraded(&mut self, e: &DiscoveryError) {
        match &mut self.health {
            Health::Degraded { reason, .. } => *reason = e.to_string(),
            _ => {
                tracing::warn!(
                    error = %e,
                    members = self.members.len(),
                    "etcd unreachable: keeping the last membership view (degraded) and retrying"
                );
                self.health = Health::Degraded {
                    since: Instant::now(),
                    reason: e.to_string(),
                };
            }
        }
        self.publish();
    }
}

async fn follow(cfg: EtcdConfig, tx: watch::Sender<View>, mut stop: watch::Receiver<bool>) {
    let mut state = State {
        cfg,
        members: BTreeMap::new(),
        health: Health::Connecting,
        refused: 0,
        tx,
    };
    let mut backoff = FIRST_BACKOFF;
    loop {
        if *stop.borrow() {
            return;
        }
        match session(&mut state, &mut stop).await {
            Ok(()) => return,
            Err(e) => {
                if state.health == Health::Live {
                    backoff = FIRST_BACKOFF;
                }
                state.degraded(&e);
            }
        }
        if sleep_or_stop(backoff, &mut stop).await {
            return;
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// One connection's worth: get the prefix (the whole view, replacing the
/// old one), then watch from the next revision until stopped (`Ok`) or
/// until something fails (`Err`: the caller marks the view degraded and
/// starts over).
async fn session(
    state: &mut State,
    stop: &mut watch::Receiver<bool>,
) -> Result<(), DiscoveryError> {
    let cfg = state.cfg.clone();
    let mut client = connect(&cfg).await?;
    let got = bounded(
        "get the mesh prefix",
        cfg.dial_timeout,
        client.get(cfg.prefix.as_str(), Some(GetOptions::new().with_prefix())),
    )
    .await?;
    let revision = got.header().map_or(0, |h| h.revision());
    state.members.clear();
    for kv in got.kvs() {
        state.put(kv.key(), kv.value());
    }
    let mut stream = bounded(
        "watch the mesh prefix",
        cfg.dial_timeout,
        client.watch(
            cfg.prefix.as_str(),
            Some(
                WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(revision + 1),
            ),
        ),
    )
    .await?;
    if state.health != Health::Live {
        tracing::info!(
            members = state.members.len(),
            revision,
            "etcd: following the mesh prefix"
        );
    }
    state.health = Health::Live;
    state.publish();
    loop {
        let msg = tokio::select! {
            m = stream.message() => m,
            r = stop.wait_for(|s| *s) => { let _ = r; return Ok(()); }
        };
        let resp = match msg {
            Ok(Some(r)) => r,
            Ok(None) => return Err(DiscoveryError::Watch("the stream ended".into())),
            Err(source) => {
                return Err(DiscoveryError::Etcd {
                    what: "watch",
                    source,
                })
            }
        };
        if resp.canceled() {
            // Compacted past our revision, or cancelled by the server:
            // start over from a fresh get.
            return Err(DiscoveryError::Watch(format!(
                "cancelled (compact revision {}): {}",
                resp.compact_revision(),
                resp.cancel_reason()
            )));
        }
        if resp.events().is_empty() {
            continue;
        }
        for ev in resp.events() {
            // The raw event (etcd-client's `event_type()` panics on a type
            // it does not know; this is network input).
            let (kind, kv) = (ev.0.r#type, ev.0.kv.as_ref());
            let Some(kv) = kv else { continue };
            match kind {
                0 => state.put(&kv.key, &kv.value),
                1 => state.delete(&kv.key),
                other => {
                    state.refused += 1;
                    tracing::warn!(kind = other, "etcd: watch event of an unknown type ignored");
                }
            }
        }
        state.publish();
    }
}
