//! The mesh process `kvmesh soak` starts and watches.

use super::*;

/// The `serve` child; killed on drop.
#[derive(Debug)]
pub(crate) struct MeshChild {
    pub(crate) child: Child,
    pub(crate) log: PathBuf,
}

impl Drop for MeshChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// The `serve` flags of the soak's mesh.
pub(super) fn soak_serve_flags(a: &SoakArgs, kv_pool_tokens: usize) -> Vec<String> {
    let mut flags: Vec<String> = vec![
        "--transport".into(),
        a.transport.to_string(),
        "--page-size".into(),
        a.model.page_size.to_string(),
        "--kv-pool-tokens".into(),
        kv_pool_tokens.to_string(),
        "--scrub".into(),
        a.model.scrub.as_str().into(),
    ];
    if let Some(n) = a.model.max_model_len {
        flags.extend(["--max-model-len".into(), n.to_string()]);
    }
    if a.model.poison || !a.no_poison {
        flags.push("--poison".into());
    }
    if a.model.exact {
        flags.push("--exact".into());
    }
    if a.fault_rate > 0.0 {
        flags.extend([
            "--fault-injection".into(),
            "--lease-ms".into(),
            a.lease_ms.to_string(),
            "--abort-timeout-ms".into(),
            a.abort_timeout_ms.to_string(),
        ]);
    }
    flags.extend(a.serve_args.iter().cloned());
    flags
}

/// Starts `<this exe> serve --model MODEL` on free ports with `flags`
/// after the model's, its stderr to `log` (default: a file named after
/// `label` in the temporary directory), and returns it with the gateway's
/// `HOST:PORT` once it said `READY=1` ([`kvmesh_ready`]).
pub(crate) fn start_mesh(
    model: &Path,
    flags: &[String],
    log: Option<PathBuf>,
    label: &str,
) -> Result<(MeshChild, String)> {
    let exe = std::env::current_exe().context("locating the kvmesh binary")?;
    let log = log.unwrap_or_else(|| {
        std::env::temp_dir().join(format!("kvmesh-{label}-{}-serve.log", std::process::id()))
    });
    let log_file =
        std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    let mut cmd = Command::new(exe);
    cmd.arg("serve")
        .arg("--model")
        .arg(model)
        .args(["--http-port", "0", "--grpc-port", "0"])
        .args(flags);
    if std::env::var_os("KVMESH_LOG").is_none() {
        cmd.env("KVMESH_LOG", "warn");
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log_file));
    let waiter = kvmesh_ready::Waiter::new().context("a readiness socket")?;
    cmd.env(kvmesh_ready::NOTIFY_SOCKET, waiter.path());
    let mut child = cmd.spawn().context("starting kvmesh serve")?;
    let stdout = child.stdout.take().context("serve's stdout")?;
    // Drained so the server never blocks on its stdout.
    std::thread::spawn(move || for _ in BufReader::new(stdout).lines() {});
    let mut mesh = MeshChild { child, log };
    let ready = waiter.wait(Duration::from_secs(300), || {
        mesh.child.try_wait().ok().flatten().map(|s| s.to_string())
    });
    match ready.and_then(|r| Ok(r.require("KVMESH_HTTP")?.to_owned())) {
        Ok(addr) => Ok((mesh, addr)),
        Err(e) => bail!(
            "kvmesh serve never got ready: {e}; its log {}:\n{}",
            mesh.log.display(),
            log_tail(&mesh.log)
        ),
    }
}

/// `http://HOST:PORT[/v1]` or `HOST:PORT` to `HOST:PORT`.
pub(crate) fn host_port(url: &str) -> String {
    let u = url.trim().trim_end_matches('/');
    let u = u.strip_prefix("http://").unwrap_or(u);
    u.trim_end_matches("/v1").to_owned()
}

/// Resident memory of `pid`, KiB (Linux).
pub(super) fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// Waits (up to 120 s) until the gateway says a prefill and a decode node
/// are up; fails early if the started mesh exits.
pub(crate) async fn wait_healthy(addr: &str, mesh: &mut Option<MeshChild>) -> Result<()> {
    let started = Instant::now();
    loop {
        if matches!(http::get(addr, "/health").await, Ok(r) if r.status == 200) {
            return Ok(());
        }
        if let Some(m) = mesh.as_mut() {
            if let Some(status) = m.child.try_wait()? {
                bail!(
                    "kvmesh serve exited ({status}); its log {}:\n{}",
                    m.log.display(),
                    log_tail(&m.log)
                );
            }
        }
        if started.elapsed() > Duration::from_secs(120) {
            bail!("the mesh at {addr} was not healthy within 120 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
