//! `doctor --url`: the checks of a running mesh through its router's view
//! (its `/version`, `/health`, `/v1/models` and `/metrics`), and the
//! router's own rows, which `doctor --config` adds too.

use super::*;

/// The checks of a running mesh through its router's view.
pub(super) fn through_router(url: &str, timeout: Duration, key: Option<&str>) -> Result<Report> {
    let addr = url
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_owned();
    if url.starts_with("https://") || addr.contains('/') || addr.rsplit_once(':').is_none() {
        anyhow::bail!("--url {url:?}: expected http://HOST:PORT (the router's HTTP address)");
    }
    let mut report = Report { checks: Vec::new() };
    if !router(&mut report, &addr, timeout, key) {
        return Ok(report);
    }
    let metrics = match http_get(&addr, "/metrics", timeout, key) {
        Ok(r) if r.status == 200 => kvmesh_client::Metrics::parse(r.text()),
        Ok(r) => {
            let hint = if matches!(r.status, 401 | 403) {
                ": the router has API keys; give --api-key a key with the metrics scope"
            } else {
                ""
            };
            report.add(
                "router",
                "router",
                "metrics",
                Status::Fail,
                format!("HTTP {} from {addr}/metrics{hint}", r.status),
            );
            return Ok(report);
        }
        Err(e) => {
            report.add("router", "router", "metrics", Status::Fail, e);
            return Ok(report);
        }
    };
    let model_len = http_get(&addr, "/v1/models", timeout, key)
        .ok()
        .and_then(|r| r.json().ok())
        .and_then(|j| j["data"][0]["max_model_len"].as_u64());
    let mut reports = Vec::new();
    let nodes: Vec<(String, String, f64)> = metrics
        .named("kvmesh_node_up")
        .filter_map(|s| {
            Some((
                s.label("node")?.to_owned(),
                s.label("role")?.to_owned(),
                s.value,
            ))
        })
        .collect();
    if nodes.is_empty() {
        report.add(
            "mesh",
            "all",
            "nodes",
            Status::Fail,
            "the router names no node".into(),
        );
    }
    for (name, role, up) in nodes {
        let role: &'static str = if role == "decode" {
            "decode"
        } else {
            "prefill"
        };
        if up != 1.0 {
            report.add(
                &name,
                role,
                "up at the router",
                Status::Fail,
                "the router's load polls fail: the node is down, draining, or refuses the router's proof of the mesh secret".into(),
            );
            for c in ["pool holds a context", "clock"] {
                report.add(
                    &name,
                    role,
                    c,
                    Status::Skip,
                    "the router has no report of it".into(),
                );
            }
            continue;
        }
        report.add(
            &name,
            role,
            "up at the router",
            Status::Ok,
            "answers the router's load polls (it accepts the mesh secret)".into(),
        );
        let at = [("node", name.as_str())];
        let gauge = |metric: &str| metrics.first(metric, &at);
        let info = metrics.named("kvmesh_node_info").find(|s| s.has(&at));
        let label = |l: &str| info.and_then(|s| s.label(l)).unwrap_or_default().to_owned();
        let r = LoadReport {
            node: name.clone(),
            version: label("version"),
            model: label("model"),
            kv_dtype: label("kv_dtype"),
            cpu_kernels: label("cpu_kernels"),
            cpu_numerics: label("cpu_numerics"),
            max_model_len: label("max_model_len").parse().unwrap_or(0),
            max_seq_tokens: gauge("kvmesh_node_max_sequence_tokens").unwrap_or(0.0) as u64,
            page_size: gauge("kvmesh_node_page_size_tokens").unwrap_or(0.0) as u32,
            ..LoadReport::default()
        };
        pool_holds_context(&mut report, &name, role, &r, model_len.unwrap_or(0));
        let skew = gauge("kvmesh_node_clock_skew_seconds").map(|s| (s * 1000.0) as i128);
        clock(&mut report, &name, role, skew, Duration::ZERO, "the router");
        reports.push((name, role, r));
    }
    across(&mut report, None, &reports);
    Ok(report)
}

/// The model the router serves, as `/v1/models` describes it (read from
/// its metadata, without weights): a row to read, failed only when the
/// router cannot say.
fn model(report: &mut Report, reply: Result<kvmesh_client::Reply, String>) {
    let described = reply.ok().filter(|r| r.status == 200).and_then(|r| {
        let j = r.json().ok()?;
        let m = &j["data"][0];
        Some(format!(
            "{}: {}, weights {}, context {}",
            m["id"].as_str()?,
            m["architecture"].as_str()?,
            m["quantization"].as_str()?,
            m["max_model_len"].as_u64()?
        ))
    });
    let (status, detail) = match described {
        Some(d) => (Status::Ok, d),
        None => (
            Status::Fail,
            "/v1/models does not describe the model (id, architecture, quantization, max_model_len)"
                .into(),
        ),
    };
    report.add("router", "router", "model", status, detail);
}

/// `GET path` from `addr`, waiting at most `timeout`.
fn http_get(
    addr: &str,
    path: &'static str,
    timeout: Duration,
    key: Option<&str>,
) -> Result<kvmesh_client::Reply, String> {
    let (tx, rx) = std::sync::mpsc::channel();
    let at = addr.to_owned();
    let mut req = kvmesh_client::http::Request::get(path);
    if let Some(key) = key {
        req = req.bearer(key);
    }
    std::thread::spawn(move || {
        let _ = tx.send(kvmesh_client::blocking::request(&at, &req).map_err(|e| e.to_string()));
    });
    rx.recv_timeout(timeout)
        .unwrap_or_else(|_| Err(format!("no answer within {} ms", timeout.as_millis())))
}

/// The router's HTTP port at `addr`; whether it answered.
pub(super) fn router(
    report: &mut Report,
    addr: &str,
    timeout: Duration,
    key: Option<&str>,
) -> bool {
    let get = |path: &'static str| http_get(addr, path, timeout, key);
    let reply = get("/version");
    match reply {
        Ok(r) if r.status == 200 => {
            let v = r
                .json()
                .ok()
                .and_then(|j| j["version"].as_str().map(str::to_owned))
                .unwrap_or_default();
            let status = if v == env!("CARGO_PKG_VERSION") {
                Status::Ok
            } else {
                Status::Fail
            };
            report.add(
                "router",
                "router",
                "version",
                status,
                format!("{v:?} at {addr}"),
            );
            let (status, detail) = match get("/health") {
                Ok(h) if h.status == 200 => (Status::Ok, "healthy".into()),
                Ok(h) => (
                    Status::Fail,
                    format!("HTTP {}: {}", h.status, h.text().trim()),
                ),
                Err(e) => (Status::Fail, e),
            };
            report.add("router", "router", "health", status, detail);
            model(report, get("/v1/models"));
            true
        }
        Ok(r) => {
            report.add(
                "router",
                "router",
                "version",
                Status::Fail,
                format!("HTTP {} from {addr}/version", r.status),
            );
            false
        }
        Err(e) => {
            report.add(
                "router",
                "router",
                "HTTP reachable",
                Status::Fail,
                format!("{addr}: {e}"),
            );
            false
        }
    }
}
