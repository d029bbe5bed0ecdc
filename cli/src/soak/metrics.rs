//! The figures the soak reads from the mesh's /metrics.

use super::*;

/// The figures the soak reads from /metrics.
#[derive(Debug, Default)]
pub(super) struct MeshFigures {
    /// node -> (pages total, pages free).
    pub(super) pages: BTreeMap<String, (Option<f64>, Option<f64>)>,
    /// node -> guard violations.
    pub(super) guard: BTreeMap<String, f64>,
    /// (node, outcome) -> reservations ended.
    pub(super) reservations: BTreeMap<(String, String), f64>,
    /// outcome -> router requests.
    pub(super) requests: BTreeMap<String, f64>,
    /// node -> prompt tokens its prefix cache supplied.
    pub(super) cache_hits: BTreeMap<String, f64>,
}

impl MeshFigures {
    #[cfg(test)]
    pub(super) fn from_text(text: &str) -> Self {
        Self::of(&kvmesh_client::metrics::parse(text))
    }

    fn of(samples: &[kvmesh_client::Sample]) -> Self {
        let mut f = Self::default();
        for s in samples {
            let node = s.labels.get("node").cloned().unwrap_or_default();
            match s.name.as_str() {
                "kvmesh_node_kv_pages_total" => f.pages.entry(node).or_default().0 = Some(s.value),
                "kvmesh_node_kv_pages_free" => f.pages.entry(node).or_default().1 = Some(s.value),
                "kvmesh_node_kv_guard_violations_total" => {
                    f.guard.insert(node, s.value);
                }
                "kvmesh_node_reservations_total" => {
                    let outcome = s.labels.get("outcome").cloned().unwrap_or_default();
                    f.reservations.insert((node, outcome), s.value);
                }
                "kvmesh_node_prefix_cache_hit_tokens_total" => {
                    f.cache_hits.insert(node, s.value);
                }
                "kvmesh_requests_total" => {
                    let outcome = s.labels.get("outcome").cloned().unwrap_or_default();
                    f.requests.insert(outcome, s.value);
                }
                _ => {}
            }
        }
        f
    }

    /// Every node reports its pages, all free.
    pub(super) fn idle(&self) -> bool {
        !self.pages.is_empty() && self.pages.values().all(|(t, f)| t.is_some() && t == f)
    }

    /// Pages held per node (`None`: the node reports no pages).
    pub(super) fn held(&self) -> BTreeMap<String, Option<f64>> {
        self.pages
            .iter()
            .map(|(n, (t, f))| (n.clone(), t.zip(*f).map(|(t, f)| t - f)))
            .collect()
    }
}

pub(super) async fn figures(addr: &str) -> Result<MeshFigures, String> {
    let m = kvmesh_client::metrics::scrape(addr)
        .await
        .map_err(|e| e.to_string())?;
    Ok(MeshFigures::of(m.samples()))
}

/// Waits for every node to report all pages free, at most `bound`; returns
/// the last figures and whether the mesh went idle.
pub(super) async fn wait_idle(addr: &str, bound: Duration) -> (MeshFigures, bool) {
    // Load reports are polled every 200 ms; one older than the last request
    // may predate it.
    tokio::time::sleep(Duration::from_millis(450)).await;
    let deadline = Instant::now() + bound;
    loop {
        let f = figures(addr).await.unwrap_or_default();
        if f.idle() {
            return (f, true);
        }
        if Instant::now() >= deadline {
            return (f, false);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

pub(super) fn delta<K: Ord + Clone>(
    end: &BTreeMap<K, f64>,
    start: &BTreeMap<K, f64>,
) -> BTreeMap<K, f64> {
    end.iter()
        .map(|(k, v)| (k.clone(), v - start.get(k).copied().unwrap_or(0.0)))
        .filter(|(_, v)| *v != 0.0)
        .collect()
}
