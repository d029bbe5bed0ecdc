//! Socket addresses between Rust and UCX's `sockaddr_storage`.

use std::mem::MaybeUninit;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::ptr;

use crate::sys;

/// A socket address as UCX takes it.
pub(crate) struct SockAddr {
    pub(crate) storage: libc::sockaddr_storage,
    len: libc::socklen_t,
}

impl SockAddr {
    pub(crate) fn new(a: SocketAddr) -> Self {
        // SAFETY: all-zero sockaddr_storage is valid.
        let mut storage: libc::sockaddr_storage = unsafe { MaybeUninit::zeroed().assume_init() };
        let len = match a {
            SocketAddr::V4(v4) => {
                let sin = libc::sockaddr_in {
                    sin_family: libc::AF_INET as libc::sa_family_t,
                    sin_port: v4.port().to_be(),
                    sin_addr: libc::in_addr {
                        s_addr: u32::from_ne_bytes(v4.ip().octets()),
                    },
                    sin_zero: [0; 8],
                };
                // SAFETY: sockaddr_storage is larger and suitably aligned.
                unsafe { ptr::write(ptr::addr_of_mut!(storage).cast(), sin) };
                std::mem::size_of::<libc::sockaddr_in>()
            }
            SocketAddr::V6(v6) => {
                let sin6 = libc::sockaddr_in6 {
                    sin6_family: libc::AF_INET6 as libc::sa_family_t,
                    sin6_port: v6.port().to_be(),
                    sin6_flowinfo: v6.flowinfo(),
                    sin6_addr: libc::in6_addr {
                        s6_addr: v6.ip().octets(),
                    },
                    sin6_scope_id: v6.scope_id(),
                };
                // SAFETY: as above.
                unsafe { ptr::write(ptr::addr_of_mut!(storage).cast(), sin6) };
                std::mem::size_of::<libc::sockaddr_in6>()
            }
        };
        Self {
            storage,
            len: len as libc::socklen_t,
        }
    }

    pub(crate) fn as_ucs(&self) -> sys::ucs_sock_addr_t {
        sys::ucs_sock_addr_t {
            addr: ptr::addr_of!(self.storage).cast(),
            addrlen: self.len,
        }
    }
}

/// A `sockaddr_storage` UCX filled in, as a socket address.
pub(crate) fn socket_addr(s: &sys::sockaddr_storage) -> Option<SocketAddr> {
    let family = i32::from(s.ss_family);
    let p: *const sys::sockaddr_storage = s;
    if family == libc::AF_INET {
        // SAFETY: the family says it holds a sockaddr_in.
        let sin: libc::sockaddr_in = unsafe { ptr::read_unaligned(p.cast()) };
        let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
        Some(SocketAddr::V4(SocketAddrV4::new(
            ip,
            u16::from_be(sin.sin_port),
        )))
    } else if family == libc::AF_INET6 {
        // SAFETY: the family says it holds a sockaddr_in6.
        let sin6: libc::sockaddr_in6 = unsafe { ptr::read_unaligned(p.cast()) };
        Some(SocketAddr::V6(SocketAddrV6::new(
            Ipv6Addr::from(sin6.sin6_addr.s6_addr),
            u16::from_be(sin6.sin6_port),
            sin6.sin6_flowinfo,
            sin6.sin6_scope_id,
        )))
    } else {
        None
    }
}

/// The unspecified address is not one to connect to: the loopback of its
/// family instead (a listener bound to 0.0.0.0 reports that).
pub(crate) fn connectable(a: SocketAddr) -> SocketAddr {
    match a.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => {
            SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), a.port())
        }
        IpAddr::V6(ip) if ip.is_unspecified() => {
            SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), a.port())
        }
        _ => a,
    }
}
