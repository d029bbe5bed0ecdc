//! Network namespaces for the lab (`ip netns`, so an operator can look
//! inside one with `ip netns exec`): created under a name that carries
//! this process's id, deleted on drop, and swept at the next lab's start
//! when the process that made them is gone (a crashed or killed run).

use std::path::Path;
use std::process::Command;

/// Every lab namespace's name starts with this, then `PID-`.
pub const PREFIX: &str = "kvmesh-lab-";

/// Runs `ip ARGS`, failing with its stderr.
pub fn ip(args: &[&str]) -> Result<(), String> {
    run("ip", args)
}

/// Runs `program ARGS`, failing with its stderr.
pub fn run(program: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("{program}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// One namespace; deleted on drop.
#[derive(Debug)]
pub struct Netns {
    /// Its name (`ip netns` lists it).
    pub name: String,
}

impl Netns {
    /// Creates `PREFIX PID-SERIAL-HOST` with its loopback up and IPv6 off
    /// (the links carry IPv4 only).
    pub fn create(serial: u32, host: &str) -> Result<Self, String> {
        let name = format!("{PREFIX}{}-{serial}-{host}", std::process::id());
        ip(&["netns", "add", &name])?;
        let ns = Self { name };
        ip(&["-n", &ns.name, "link", "set", "lo", "up"])?;
        ns.exec(&["sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1"])?;
        Ok(ns)
    }

    /// Runs `ARGS` inside it (`ip netns exec`).
    pub fn exec(&self, args: &[&str]) -> Result<(), String> {
        let mut all = vec!["netns", "exec", &self.name];
        all.extend_from_slice(args);
        ip(&all)
    }

    /// Runs `f` on a thread of its own inside this namespace (sockets it
    /// opens, and threads it starts, live there); its result.
    pub fn enter<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        enter(&self.name, f)
    }
}

/// [`Netns::enter`] by name.
pub fn enter<T: Send>(name: &str, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            join(name).unwrap_or_else(|e| panic!("{e}"));
            f()
        })
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
    })
}

/// Moves the calling thread into the namespace `name`.
pub fn join(name: &str) -> Result<(), String> {
    let path = Path::new("/run/netns").join(name);
    let f = std::fs::File::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    use std::os::fd::AsRawFd;
    // SAFETY: setns(2) on an fd this function holds open, for the calling
    // thread only.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(format!(
            "setns {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Err(e) = ip(&["netns", "del", &self.name]) {
            eprintln!("netlab: {e}");
        }
    }
}

/// Deletes the lab namespaces whose creating process is gone; their names.
pub fn sweep_stale() -> Vec<String> {
    let mut swept = Vec::new();
    let Ok(dir) = std::fs::read_dir("/run/netns") else {
        return swept;
    };
    for e in dir.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(PREFIX)
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if Path::new("/proc").join(pid.to_string()).exists() {
            continue;
        }
        // Whatever still runs in it (its processes get SIGKILL with their
        // test process, but a namespace outlives `ip netns del` while any
        // process is in it).
        if let Ok(out) = Command::new("ip").args(["netns", "pids", &name]).output() {
            for p in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                if let Ok(p) = p.parse::<libc::pid_t>() {
                    // SAFETY: kill(2) with a pid just listed in a lab
                    // namespace whose creator is gone.
                    unsafe { libc::kill(p, libc::SIGKILL) };
                }
            }
        }
        if ip(&["netns", "del", &name]).is_ok() {
            swept.push(name);
        }
    }
    swept
}

/// Whether this kernel has the netem qdisc: tried on a scratch
/// namespace's loopback (a missing module is loaded on first use where
/// the kernel can).
pub fn has_netem(scratch: &Netns) -> bool {
    scratch
        .exec(&[
            "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms",
        ])
        .is_ok()
        && scratch
            .exec(&["tc", "qdisc", "del", "dev", "lo", "root"])
            .is_ok()
}
