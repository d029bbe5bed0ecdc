//! Watching a writer process for exit (pidfd), so a one-sided write path
//! known to be dead counts as revoked.

use std::io;
use std::os::fd::OwnedFd;

/// Another process, watched for exit through a pidfd (Linux). The decode
/// node uses it to learn that a writer's one-sided write path is gone, so
/// that `ShmRegion::lane_force_reset` is safe. The pid must come from a
/// trusted source (an authenticated peer, `SO_PEERCRED`) while the process
/// is known alive; a pid already reused names the wrong process.
#[derive(Debug)]
pub struct PeerProcess {
    fd: OwnedFd,
    pid: i32,
}

impl PeerProcess {
    /// Opens a pidfd for `pid` (`pidfd_open`); pid 0 or negative is
    /// `InvalidInput`.
    pub fn from_pid(pid: i32) -> io::Result<Self> {
        // `from_raw` debug-asserts a non-negative pid, so test first.
        let p = Some(pid)
            .filter(|&p| p > 0)
            .and_then(rustix::process::Pid::from_raw)
            .ok_or_else(|| {
                io::Error::new(io::ErrorKind::InvalidInput, format!("invalid pid {pid}"))
            })?;
        let fd = rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty())?;
        Ok(Self { fd, pid })
    }

    /// The process id.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// True once the process has exited (its pidfd is readable). Never
    /// blocks. A failed poll answers false: the caller keeps the lane closed
    /// and asks again later, which is the safe side.
    pub fn has_exited(&self) -> bool {
        use rustix::event::{poll, PollFd, PollFlags, Timespec};
        let zero = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        loop {
            let mut fds = [PollFd::new(&self.fd, PollFlags::IN)];
            match poll(&mut fds, Some(&zero)) {
                Ok(n) => return n > 0 && fds[0].revents().contains(PollFlags::IN),
                Err(rustix::io::Errno::INTR) => continue,
                Err(_) => return false,
            }
        }
    }
}
