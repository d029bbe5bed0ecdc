//! The listening socket's door, closed before the listener is destroyed.
//!
//! UCX 1.13 (Debian bookworm's) crashes its async thread when a
//! connection accepted by a listener delivers its request after
//! `ucp_listener_destroy` freed the listener: the sockcm endpoint still
//! points at it (`ucp_cm_server_conn_request_cb`, seen in CI while a
//! writer topped up spare endpoints to a target being dropped). UCX gives
//! no handle on the socket and no way to stop accepting short of the
//! destroy, so the target finds the socket itself, by its bound address,
//! right after creating the listener, and at shutdown attaches a
//! drop-everything packet filter to it. The kernel then answers no new
//! connection (a SYN is dropped; a child socket would inherit the filter),
//! and the requests already accepted arrive while the target still
//! progresses the worker, before the destroy.
//!
//! Cost: one scan of `/proc/self/fd` per target (a few µs per open file),
//! one `setsockopt` at shutdown.

use std::net::SocketAddr;
use std::os::fd::RawFd;

use crate::addr::socket_addr;
use crate::sys;

/// The listening TCP socket UCX made for a target's listener. UCX closes
/// it only in `ucp_listener_destroy`, which the owner calls after the last
/// use of this value, so the descriptor cannot be reused under it.
#[derive(Debug)]
pub(crate) struct ListenGate {
    fd: RawFd,
}

impl ListenGate {
    /// The process's listening TCP socket bound to `bound`, if `/proc`
    /// shows one. Two listening sockets cannot share an address (UCX sets
    /// no `SO_REUSEPORT`), so at most one matches.
    pub(crate) fn find(bound: SocketAddr) -> Option<Self> {
        let dir = std::fs::read_dir("/proc/self/fd").ok()?;
        dir.filter_map(Result::ok)
            .filter_map(|e| e.file_name().to_str()?.parse::<RawFd>().ok())
            .find(|&fd| is_listener_at(fd, bound))
            .map(|fd| Self { fd })
    }

    /// Drops every packet the socket would take from now on. Returns
    /// whether the filter was attached.
    pub(crate) fn close(&self) -> bool {
        let mut drop_all = [libc::sock_filter {
            // BPF_RET | BPF_K with k = 0: keep 0 bytes, that is, drop.
            code: (libc::BPF_RET | libc::BPF_K) as u16,
            jt: 0,
            jf: 0,
            k: 0,
        }];
        let prog = libc::sock_fprog {
            len: 1,
            filter: drop_all.as_mut_ptr(),
        };
        // SAFETY: `fd` is the live socket (see the type's doc); the
        // program outlives the call, which copies it.
        let rc = unsafe {
            libc::setsockopt(
                self.fd,
                libc::SOL_SOCKET,
                libc::SO_ATTACH_FILTER,
                (&raw const prog).cast(),
                size_of::<libc::sock_fprog>() as libc::socklen_t,
            )
        };
        rc == 0
    }
}

fn is_listener_at(fd: RawFd, bound: SocketAddr) -> bool {
    let mut on: libc::c_int = 0;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: out-pointers sized as passed; a descriptor that is not a
    // socket (or was closed meanwhile) only makes the call fail.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ACCEPTCONN,
            (&raw mut on).cast(),
            &mut len,
        )
    };
    if rc != 0 || on == 0 {
        return false;
    }
    // SAFETY: zeroed storage is valid; the length says its size.
    let mut ss: sys::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = size_of::<sys::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: as above.
    let rc = unsafe { libc::getsockname(fd, (&raw mut ss).cast(), &mut len) };
    rc == 0 && socket_addr(&ss) == Some(bound)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::ErrorKind;
    use std::net::{TcpListener, TcpStream};
    use std::time::Duration;

    #[test]
    fn finds_the_listener_by_address_and_closes_its_door() {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let at = l.local_addr().expect("addr");
        // A connected socket on another port is not taken for it.
        let other = TcpListener::bind("127.0.0.1:0").expect("bind");
        let _c = TcpStream::connect(other.local_addr().expect("addr")).expect("connect");
        let gate = ListenGate::find(at).expect("the listener is found");
        assert_eq!(gate.fd, std::os::fd::AsRawFd::as_raw_fd(&l));
        // Before: a connection is taken.
        TcpStream::connect_timeout(&at, Duration::from_secs(2)).expect("connect before");
        assert!(gate.close());
        // After: the SYN is dropped, so the connect times out.
        let e =
            TcpStream::connect_timeout(&at, Duration::from_millis(300)).expect_err("connect after");
        assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
        // No listener at an unbound port.
        drop(other);
        assert!(ListenGate::find("127.0.0.1:1".parse().expect("addr")).is_none());
    }
}
