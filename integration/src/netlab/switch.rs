//! The lab's link emulator where the kernel has no `netem`: one TUN
//! device per host, moved into that host's namespace, and a switch in
//! this process that carries every IPv4 packet from one host's TUN to
//! another's after the sender's link has shaped it.
//!
//! Per packet, from host A to host B (A's link shape, B's link shape):
//! - dropped if either link is partitioned (the switch port is down: the
//!   packet vanishes, as on a pulled cable; no ICMP, no reset),
//! - dropped with A's loss probability,
//! - serialised at A's rate on A's uplink and at B's rate on B's downlink
//!   (two senders to one host share its port, as on a real switch), each
//!   port tail-dropping past [`QUEUE_LIMIT`] of backlog,
//! - delivered A's latency +- A's jitter (uniform) after it left the
//!   queues, never before an earlier packet of the same pair (a wire does
//!   not reorder; netem with jitter would).
//!
//! So with every link shaped alike, one-way delay is the latency and the
//! round trip twice it. The kernels' own TCP stacks see the delay, loss
//! and partitions; nothing above them is told. Costs: two syscalls and a
//! heap entry per packet, and wake-ups of this process's scheduler thread,
//! so its precision is the host's timer slack (tens of microseconds idle,
//! more on a loaded host) and its ceiling is a few Gbit/s with the
//! [`MTU`] below (5-7 Gbit/s of bulk TCP on a loaded 2-core host;
//! `tests/netns_bench.rs` measures it with every run).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::Shape;

/// Each TUN's MTU: jumbo frames, as a datacenter fabric runs. Fewer,
/// larger packets keep a userspace switch's packet rate (its cost) down.
pub const MTU: u32 = 9000;
/// Backlog a port holds before it drops (a switch's buffer, in time at the
/// port's rate, like tbf's `latency`).
pub const QUEUE_LIMIT: Duration = Duration::from_millis(20);

/// Packet counts of one host's link, both ways.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// Packets the host sent that were delivered.
    pub delivered: u64,
    /// Bytes of those.
    pub bytes: u64,
    /// Dropped by the link's loss probability.
    pub lost: u64,
    /// Dropped because either end was partitioned.
    pub partitioned: u64,
    /// Dropped at a full port queue.
    pub queue_drops: u64,
}

struct Link {
    shape: Shape,
    up: bool,
    /// When this host's uplink, and its downlink, are next free.
    up_free: Instant,
    down_free: Instant,
    stats: LinkStats,
}

struct Pending {
    at: Instant,
    seq: u64,
    dst: usize,
    packet: Vec<u8>,
}

impl PartialEq for Pending {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Pending {}
impl PartialOrd for Pending {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Pending {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(o.at, o.seq))
    }
}

struct State {
    links: Vec<Link>,
    queue: BinaryHeap<Reverse<Pending>>,
    /// The last delivery time per (src, dst): packets of a pair stay in
    /// order.
    last: HashMap<(usize, usize), Instant>,
    seq: u64,
    rng: u64,
}

impl State {
    fn random(&mut self) -> f64 {
        // xorshift64*: enough for loss and jitter draws.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        (self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// When `len` bytes from `src` to `dst`, arriving now, are due at
    /// `dst`; `None`: dropped (and counted).
    fn schedule(&mut self, src: usize, dst: usize, len: usize, now: Instant) -> Option<Instant> {
        if !self.links[src].up || !self.links[dst].up {
            self.links[src].stats.partitioned += 1;
            return None;
        }
        let shape = self.links[src].shape;
        if shape.loss > 0.0 && self.random() < shape.loss {
            self.links[src].stats.lost += 1;
            return None;
        }
        let serial = |rate: Option<u64>| {
            rate.map_or(Duration::ZERO, |bps| {
                Duration::from_secs_f64(len as f64 * 8.0 / bps as f64)
            })
        };
        let up_start = self.links[src].up_free.max(now);
        if up_start - now > QUEUE_LIMIT {
            self.links[src].stats.queue_drops += 1;
            return None;
        }
        let up_done = up_start + serial(shape.rate_bps);
        let down_start = self.links[dst].down_free.max(up_done);
        if down_start - up_done > QUEUE_LIMIT {
            self.links[src].stats.queue_drops += 1;
            return None;
        }
        let down_done = down_start + serial(self.links[dst].shape.rate_bps);
        self.links[src].up_free = up_done;
        self.links[dst].down_free = down_done;
        let jitter = if shape.jitter.is_zero() {
            0.0
        } else {
            (self.random() * 2.0 - 1.0) * shape.jitter.as_secs_f64()
        };
        let delay = (shape.latency.as_secs_f64() + jitter).max(0.0);
        let mut at = down_done + Duration::from_secs_f64(delay);
        let last = self.last.entry((src, dst)).or_insert(now);
        at = at.max(*last);
        *last = at;
        let l = &mut self.links[src].stats;
        l.delivered += 1;
        l.bytes += len as u64;
        Some(at)
    }
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
    stop: AtomicBool,
    tuns: Vec<OwnedFd>,
    addrs: Vec<Ipv4Addr>,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The running switch; its threads stop and its TUN devices vanish on drop.
pub struct Switch {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Switch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Switch")
            .field("hosts", &self.shared.addrs)
            .finish()
    }
}

/// Opens a TUN device named `name` (no packet-info header) in the calling
/// thread's network namespace.
pub(super) fn open_tun(name: &str) -> std::io::Result<OwnedFd> {
    const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
    const IFF_TUN: libc::c_short = 0x0001;
    const IFF_NO_PI: libc::c_short = 0x1000;
    // SAFETY: a NUL-terminated literal path; the fd is checked below.
    let fd = unsafe { libc::open(c"/dev/net/tun".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: open(2) just returned this fd, owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // struct ifreq: a 16-byte name, then a union whose first member is
    // the short flags; 40 bytes in all on 64-bit Linux.
    let mut ifr = [0u8; 40];
    let n = name.len().min(15);
    ifr[..n].copy_from_slice(&name.as_bytes()[..n]);
    ifr[16..18].copy_from_slice(&(IFF_TUN | IFF_NO_PI).to_ne_bytes());
    // SAFETY: TUNSETIFF reads and writes a struct ifreq, which `ifr` is
    // large enough to hold, for the call's duration.
    if unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETIFF, ifr.as_mut_ptr()) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(fd)
}

impl Switch {
    /// Starts switching between `tuns`, host `i` owning `addrs[i]`, every
    /// link unshaped and up.
    pub(super) fn start(tuns: Vec<OwnedFd>, addrs: Vec<Ipv4Addr>) -> Self {
        let now = Instant::now();
        let links = (0..tuns.len())
            .map(|_| Link {
                shape: Shape::default(),
                up: true,
                up_free: now,
                down_free: now,
                stats: LinkStats::default(),
            })
            .collect();
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                links,
                queue: BinaryHeap::new(),
                last: HashMap::new(),
                seq: 0,
                rng: 0x9e37_79b9_7f4a_7c15 ^ u64::from(std::process::id()),
            }),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
            tuns,
            addrs,
        });
        let mut threads = Vec::new();
        for src in 0..shared.tuns.len() {
            let s = Arc::clone(&shared);
            threads.push(std::thread::spawn(move || read_port(&s, src)));
        }
        let s = Arc::clone(&shared);
        threads.push(std::thread::spawn(move || deliver(&s)));
        Self { shared, threads }
    }

    /// Shapes host `i`'s link from now on (packets already queued keep
    /// their times).
    pub fn shape(&self, i: usize, shape: Shape) {
        self.shared.lock().links[i].shape = shape;
    }

    /// Puts host `i`'s switch port down (`false`) or up: while down, every
    /// packet to or from it is dropped, and so are those queued towards it.
    pub fn set_up(&self, i: usize, up: bool) {
        let mut st = self.shared.lock();
        st.links[i].up = up;
        if !up {
            let kept: BinaryHeap<_> = std::mem::take(&mut st.queue)
                .into_iter()
                .filter(|Reverse(p)| p.dst != i)
                .collect();
            st.queue = kept;
        }
    }

    /// Host `i`'s counts so far.
    pub fn stats(&self, i: usize) -> LinkStats {
        self.shared.lock().links[i].stats
    }
}

/// Reads host `src`'s packets and schedules each.
fn read_port(s: &Shared, src: usize) {
    let fd = s.tuns[src].as_raw_fd();
    let mut buf = vec![0u8; 65_536];
    while !s.stop.load(Ordering::Relaxed) {
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the call's duration.
        if unsafe { libc::poll(&mut pfd, 1, 50) } <= 0 {
            continue;
        }
        // SAFETY: `buf` is writable for its length for the call.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        let Ok(n) = usize::try_from(n) else {
            continue;
        };
        // IPv4 only (the namespaces have IPv6 off); the destination
        // address is bytes 16..20 of the header.
        if n < 20 || buf[0] >> 4 != 4 {
            continue;
        }
        let dst_ip = Ipv4Addr::new(buf[16], buf[17], buf[18], buf[19]);
        let Some(dst) = s.addrs.iter().position(|a| *a == dst_ip) else {
            continue;
        };
        let now = Instant::now();
        let mut st = s.lock();
        let Some(at) = st.schedule(src, dst, n, now) else {
            continue;
        };
        if at <= now && st.queue.is_empty() {
            drop(st);
            write_packet(s, dst, &buf[..n]);
            continue;
        }
        let earliest = st.queue.peek().is_none_or(|Reverse(p)| at < p.at);
        st.seq += 1;
        let seq = st.seq;
        st.queue.push(Reverse(Pending {
            at,
            seq,
            dst,
            packet: buf[..n].to_vec(),
        }));
        drop(st);
        if earliest {
            s.wake.notify_one();
        }
    }
}

/// Hands each queued packet to its destination's TUN when it is due.
fn deliver(s: &Shared) {
    let mut due = Vec::new();
    let mut st = s.lock();
    while !s.stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        while st.queue.peek().is_some_and(|Reverse(p)| p.at <= now) {
            if let Some(Reverse(p)) = st.queue.pop() {
                due.push(p);
            }
        }
        if !due.is_empty() {
            drop(st);
            for p in due.drain(..) {
                write_packet(s, p.dst, &p.packet);
            }
            st = s.lock();
            continue;
        }
        let wait = st
            .queue
            .peek()
            .map_or(Duration::from_millis(50), |Reverse(p)| p.at - now);
        st = s
            .wake
            .wait_timeout(st, wait)
            .unwrap_or_else(PoisonError::into_inner)
            .0;
    }
}

fn write_packet(s: &Shared, dst: usize, packet: &[u8]) {
    // A failed write is a dropped packet, as on a wire; TCP recovers.
    // SAFETY: `packet` is readable for its length for the call.
    let _ = unsafe {
        libc::write(
            s.tuns[dst].as_raw_fd(),
            packet.as_ptr().cast(),
            packet.len(),
        )
    };
}

impl Drop for Switch {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.shared.wake.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(shapes: &[Shape]) -> State {
        let now = Instant::now();
        State {
            links: shapes
                .iter()
                .map(|s| Link {
                    shape: *s,
                    up: true,
                    up_free: now,
                    down_free: now,
                    stats: LinkStats::default(),
                })
                .collect(),
            queue: BinaryHeap::new(),
            last: HashMap::new(),
            seq: 0,
            rng: 7,
        }
    }

    #[test]
    fn a_packet_takes_the_senders_latency_and_both_ports_serialisation() {
        let a = Shape {
            latency: Duration::from_millis(5),
            rate_bps: Some(8_000_000),
            ..Shape::default()
        };
        let b = Shape {
            rate_bps: Some(8_000_000),
            ..Shape::default()
        };
        let mut st = state(&[a, b]);
        let now = Instant::now();
        // 1000 bytes at 1 MB/s: 1 ms on each port, then 5 ms on the wire.
        let at = st.schedule(0, 1, 1000, now).expect("delivered");
        assert_eq!(at - now, Duration::from_millis(7));
        // The next one queues behind it on both ports.
        let at2 = st.schedule(0, 1, 1000, now).expect("delivered");
        assert_eq!(at2 - now, Duration::from_millis(8));
    }

    #[test]
    fn a_full_port_drops_and_a_partitioned_one_drops_everything() {
        let slow = Shape {
            rate_bps: Some(8_000),
            ..Shape::default()
        };
        let mut st = state(&[slow, Shape::default()]);
        let now = Instant::now();
        // 1000 bytes at 1 kB/s: one second each; the second exceeds the
        // queue limit.
        assert!(st.schedule(0, 1, 1000, now).is_some());
        assert!(st.schedule(0, 1, 1000, now).is_none());
        assert_eq!(st.links[0].stats.queue_drops, 1);
        st.links[1].up = false;
        assert!(st.schedule(1, 0, 10, now).is_none());
        assert_eq!(st.links[1].stats.partitioned, 1);
    }

    #[test]
    fn loss_drops_about_its_share_and_jitter_never_reorders_a_pair() {
        let lossy = Shape {
            latency: Duration::from_millis(2),
            jitter: Duration::from_micros(500),
            loss: 0.05,
            rate_bps: None,
        };
        let mut st = state(&[lossy, Shape::default()]);
        let now = Instant::now();
        let mut last = now;
        let mut delays = Vec::new();
        for _ in 0..20_000 {
            if let Some(at) = st.schedule(0, 1, 100, now) {
                assert!(at >= last);
                last = at;
                delays.push(at - now);
            }
        }
        let lost = st.links[0].stats.lost;
        assert!((800..1200).contains(&lost), "{lost} of 20000 lost at 5%");
        assert!(delays[0] >= Duration::from_micros(1500), "{:?}", delays[0]);
        assert!(delays[0] <= Duration::from_micros(2500), "{:?}", delays[0]);
    }
}
