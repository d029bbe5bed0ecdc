//! Readiness: how a kvmesh process says it serves, and how whoever started
//! it waits for that without reading its stdout.
//!
//! The sender speaks systemd's notify protocol (`sd_notify(3)`): one
//! datagram of `KEY=value` lines to the Unix socket `$NOTIFY_SOCKET` names,
//! so a `Type=notify` unit works as it is. kvmesh adds keys of its own with
//! what a client needs next (systemd ignores keys it does not know):
//!
//! | key | sent by | value |
//! |---|---|---|
//! | `READY=1` | every process | its listeners are bound and it serves (`serve`: the nodes answered a load poll too) |
//! | `STOPPING=1` | every process | a drain began |
//! | `KVMESH_ROLE` | every process | `serve`, `router`, `prefill`, `decode` |
//! | `KVMESH_HTTP`, `KVMESH_GRPC` | `serve`, router | the gateway's and the public gRPC API's `HOST:PORT` |
//! | `KVMESH_NODE`, `KVMESH_LISTEN` | prefill, decode | the node's name and its gRPC `HOST:PORT` |
//!
//! Without `$NOTIFY_SOCKET` sending does nothing. The waiting side
//! ([`Waiter`]) binds a socket in a private directory, hands its path to
//! the child as `NOTIFY_SOCKET`, and returns the child's fields at
//! `READY=1`, or says that the child exited or never got ready.

use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The environment variable naming the socket.
pub const NOTIFY_SOCKET: &str = "NOTIFY_SOCKET";

/// Sends `fields` as one notification to `$NOTIFY_SOCKET`; `Ok(false)`
/// when the variable is unset (nobody waits).
pub fn notify(fields: &[(&str, &str)]) -> io::Result<bool> {
    let Some(target) = std::env::var_os(NOTIFY_SOCKET) else {
        return Ok(false);
    };
    let msg = message(fields)?;
    let sock = UnixDatagram::unbound()?;
    let target = target.as_encoded_bytes();
    if let Some(name) = target.strip_prefix(b"@") {
        // An abstract socket (systemd may hand one out).
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
        sock.send_to_addr(msg.as_bytes(), &addr)?;
    } else {
        let path = Path::new(std::ffi::OsStr::from_bytes(target));
        sock.send_to(msg.as_bytes(), path)?;
    }
    Ok(true)
}

/// The datagram: `KEY=value` lines.
fn message(fields: &[(&str, &str)]) -> io::Result<String> {
    let mut msg = String::new();
    for (k, v) in fields {
        if k.contains(['=', '\n']) || v.contains('\n') {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("notify field {k:?}: no '=' in a key, no newline in either"),
            ));
        }
        msg.push_str(k);
        msg.push('=');
        msg.push_str(v);
        msg.push('\n');
    }
    Ok(msg)
}

/// `READY=1` with `fields`; a failure to send is logged, never fatal (a
/// supervisor that cannot be told still gets a serving process).
pub fn ready(role: &str, fields: &[(&str, &str)]) {
    let mut all = vec![("READY", "1"), ("KVMESH_ROLE", role)];
    all.extend_from_slice(fields);
    send_or_warn(&all);
}

/// `STOPPING=1`: a drain began.
pub fn stopping() {
    send_or_warn(&[("STOPPING", "1")]);
}

fn send_or_warn(fields: &[(&str, &str)]) {
    if let Err(e) = notify(fields) {
        eprintln!("kvmesh: cannot notify ${NOTIFY_SOCKET}: {e}");
    }
}

/// What a process sent with `READY=1`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ready {
    fields: Vec<(String, String)>,
}

impl Ready {
    /// The value of `key`, the last one sent.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.fields
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// [`get`](Self::get), or an error naming the key.
    pub fn require(&self, key: &str) -> Result<&str, WaitError> {
        self.get(key)
            .ok_or_else(|| WaitError::Missing(key.to_owned()))
    }
}

/// Why no `READY=1` came.
#[derive(Debug)]
pub enum WaitError {
    /// The process ended first (its exit status, as the caller saw it).
    Exited(String),
    /// It did not get ready within the time given.
    TimedOut(Duration),
    /// `READY=1` came without a key the caller needs.
    Missing(String),
    /// The socket failed.
    Io(io::Error),
}

impl std::fmt::Display for WaitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Exited(s) => write!(f, "the process exited before it was ready ({s})"),
            Self::TimedOut(d) => {
                write!(f, "the process was not ready within {} s", d.as_secs_f32())
            }
            Self::Missing(k) => write!(f, "the process said READY=1 without {k}"),
            Self::Io(e) => write!(f, "the readiness socket: {e}"),
        }
    }
}

impl std::error::Error for WaitError {}

impl From<io::Error> for WaitError {
    fn from(e: io::Error) -> Self {
        Self::Io(e)
    }
}

/// The waiting side: a datagram socket in a directory only this user can
/// enter, removed on drop.
#[derive(Debug)]
pub struct Waiter {
    sock: UnixDatagram,
    path: PathBuf,
    _dir: tempfile::TempDir,
}

impl Waiter {
    /// Binds a fresh socket.
    pub fn new() -> io::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("kvmesh-ready-")
            .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .tempdir()?;
        let path = dir.path().join("notify.sock");
        let sock = UnixDatagram::bind(&path)?;
        sock.set_read_timeout(Some(Duration::from_millis(100)))?;
        Ok(Self {
            sock,
            path,
            _dir: dir,
        })
    }

    /// The value to set as [`NOTIFY_SOCKET`] in the child's environment.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Waits at most `within` for `READY=1`; `exited` is asked about ten
    /// times a second whether the process ended (`Some(status)`), so a
    /// crash is reported at once. Notifications before it (`STATUS=`
    /// lines, say) are skipped.
    pub fn wait(
        &self,
        within: Duration,
        exited: impl FnMut() -> Option<String>,
    ) -> Result<Ready, WaitError> {
        self.wait_for(within, exited, |r| r.get("READY") == Some("1"))
    }

    /// Waits at most `within` for a notification `wanted` accepts
    /// (`STOPPING=1`, say), skipping the others; as [`wait`](Self::wait)
    /// otherwise. A notification sent before the process exited is still
    /// read after.
    pub fn wait_for(
        &self,
        within: Duration,
        mut exited: impl FnMut() -> Option<String>,
        wanted: impl Fn(&Ready) -> bool,
    ) -> Result<Ready, WaitError> {
        let start = Instant::now();
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match self.sock.recv(&mut buf) {
                Ok(n) => {
                    let r = parse(&buf[..n]);
                    if wanted(&r) {
                        return Ok(r);
                    }
                    continue;
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => return Err(e.into()),
            }
            if let Some(status) = exited() {
                return Err(WaitError::Exited(status));
            }
            if start.elapsed() >= within {
                return Err(WaitError::TimedOut(within));
            }
        }
    }
}

fn parse(datagram: &[u8]) -> Ready {
    let text = String::from_utf8_lossy(datagram);
    Ready {
        fields: text
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    /// The sender's datagram through a real child process (`sh` has no
    /// notify client; this test binary is one, run as the child).
    #[test]
    fn a_child_process_ready_reaches_the_waiter_with_its_fields() {
        if std::env::var_os("KVMESH_READY_TEST_CHILD").is_some() {
            return;
        }
        let w = Waiter::new().expect("waiter");
        let mut child = Command::new(std::env::current_exe().expect("exe"))
            .args([
                "--exact",
                "tests::child_sends",
                "--nocapture",
                "--include-ignored",
            ])
            .env("KVMESH_READY_TEST_CHILD", "1")
            .env(NOTIFY_SOCKET, w.path())
            .spawn()
            .expect("spawn");
        let r = w
            .wait(Duration::from_secs(30), || {
                child.try_wait().ok().flatten().map(|s| s.to_string())
            })
            .expect("ready");
        assert_eq!(r.get("KVMESH_ROLE"), Some("router"));
        assert_eq!(r.require("KVMESH_HTTP").expect("http"), "127.0.0.1:8080");
        assert!(
            matches!(r.require("KVMESH_NODE"), Err(WaitError::Missing(k)) if k == "KVMESH_NODE")
        );
        assert!(child.wait().expect("wait").success());
    }

    #[test]
    #[ignore = "the child of the test above"]
    fn child_sends() {
        if std::env::var_os("KVMESH_READY_TEST_CHILD").is_none() {
            return;
        }
        // A status line first: skipped by the waiter.
        assert!(notify(&[("STATUS", "loading")]).expect("status"));
        ready("router", &[("KVMESH_HTTP", "127.0.0.1:8080")]);
        stopping();
    }

    #[test]
    fn a_child_that_exits_first_is_reported_not_waited_for() {
        let w = Waiter::new().expect("waiter");
        let mut child = Command::new("true")
            .env(NOTIFY_SOCKET, w.path())
            .spawn()
            .expect("spawn true");
        let e = w
            .wait(Duration::from_secs(30), || {
                child.try_wait().ok().flatten().map(|s| s.to_string())
            })
            .expect_err("never ready");
        assert!(matches!(e, WaitError::Exited(_)), "{e}");
    }

    #[test]
    fn without_a_socket_nothing_is_sent_and_newlines_are_refused() {
        // Only this test reads the variable in this process when unset.
        if std::env::var_os(NOTIFY_SOCKET).is_none() {
            assert!(!notify(&[("READY", "1")]).expect("no socket"));
        }
        let w = Waiter::new().expect("waiter");
        let e = w
            .wait(Duration::from_millis(150), || None)
            .expect_err("nothing sent");
        assert!(matches!(e, WaitError::TimedOut(_)), "{e}");
        let m = message(&[("READY", "1"), ("KVMESH_HTTP", "a:1")]).expect("message");
        assert_eq!(m, "READY=1\nKVMESH_HTTP=a:1\n");
        assert_eq!(parse(m.as_bytes()).get("KVMESH_HTTP"), Some("a:1"));
        assert!(message(&[("STATUS", "two\nlines")]).is_err());
        assert!(message(&[("A=B", "1")]).is_err());
    }
}
