//! Hosts with their own network stacks (issue 36 item 2): a lab of Linux
//! network namespaces, one per host, joined by links this module shapes
//! and cuts, with addresses of the benchmarking range 198.18.0.0/24
//! (RFC 2544) that exist inside the namespaces only.
//!
//! Layout: [`ns`] creates, enters and sweeps the namespaces; [`switch`] is
//! the link emulator used where the kernel has no `netem` qdisc (a TUN
//! device per host and a switch in this process that delays, drops,
//! rate-limits and partitions); [`veth`] is the kernel's own path (veth
//! pairs into a bridge, `tc netem`/`tbf`); [`mesh`] starts etcd and a
//! kvmesh mesh on the lab's hosts and talks to it from inside the
//! router's namespace.
//!
//! Why Rust test support and not a shell script: the switch has to live in
//! a process that outlasts the links and that the test can tell to cut a
//! link at an exact moment; the tests need its counts (what was really
//! lost or cut) and the mesh's metrics in one place; and a `Drop` guard
//! cleans up on every path a test can fail by. `scripts/netns-check.sh`
//! runs the tests that use it.
//!
//! Which mechanism shapes the links: `KVMESH_NETLAB_LINKS=switch|veth`,
//! default `veth` where a probe finds `netem`, else `switch`; every lab
//! says which in [`Lab::mechanism`] and the tests print it.
//!
//! Cleanup: a lab's namespaces are named `kvmesh-lab-PID-SERIAL-HOST`;
//! [`Lab`]'s drop kills its processes and deletes them, and every new lab
//! first deletes those of processes that are gone (and kills what still
//! runs in them), so a run killed with SIGKILL leaves nothing behind past
//! the next one. Processes in a lab also get SIGKILL when the test process
//! dies (`PR_SET_PDEATHSIG`), and the TUN devices vanish with it.

pub mod mesh;
pub mod ns;
pub mod switch;
pub mod veth;

use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use ns::Netns;

/// How one host's link treats what the host sends (and, for the rate,
/// what it receives).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Shape {
    /// One-way delay added to each packet the host sends.
    pub latency: Duration,
    /// +- this, uniformly.
    pub jitter: Duration,
    /// Probability that a packet the host sends is lost.
    pub loss: f64,
    /// The link's rate, each way (`None`: as fast as the mechanism goes).
    pub rate_bps: Option<u64>,
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.1} ms +- {:.1} ms, {:.1}% loss, ",
            self.latency.as_secs_f64() * 1e3,
            self.jitter.as_secs_f64() * 1e3,
            self.loss * 100.0
        )?;
        match self.rate_bps {
            Some(r) if r >= 1_000_000_000 => write!(f, "{} Gbit/s", r / 1_000_000_000),
            Some(r) => write!(f, "{} Mbit/s", r / 1_000_000),
            None => write!(f, "unlimited rate"),
        }
    }
}

enum Links {
    Switch(switch::Switch),
    Veth(veth::Bridge),
}

/// One host: its name, namespace and address.
#[derive(Debug)]
pub struct Host {
    /// `etcd`, `router`, `prefill-0`, ...
    pub name: String,
    /// Its namespace.
    pub ns: Netns,
    /// Its address on the lab's network.
    pub addr: Ipv4Addr,
}

/// The lab: hosts and the links between them. Deletes everything on drop.
pub struct Lab {
    // Dropped in this order: the links (the switch's threads stop, its
    // TUN devices close), then the hosts' namespaces.
    links: Links,
    /// The hosts, in the order given.
    pub hosts: Vec<Host>,
    mechanism: String,
}

impl std::fmt::Debug for Lab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lab")
            .field("hosts", &self.hosts)
            .field("mechanism", &self.mechanism)
            .finish()
    }
}

/// Which links a lab gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mechanism {
    /// `KVMESH_NETLAB_LINKS` (`switch` or `veth`), else veth where the
    /// kernel has netem and the switch where it does not.
    Auto,
    /// The TUN switch ([`switch`]).
    Switch,
    /// veth pairs into a bridge ([`veth`]).
    Veth,
}

/// The first host's address; host `i` has `.10 + i`.
const BASE: [u8; 3] = [198, 18, 0];

impl Lab {
    /// A namespace per name in `hosts`, joined by unshaped links that are
    /// up. Panics (after cleaning up what it made) if the host cannot: not
    /// root, no `ip`, no TUN or veth.
    pub fn new(hosts: &[&str]) -> Self {
        Self::with(hosts, Mechanism::Auto)
    }

    /// [`Lab::new`] with the links `mechanism` says.
    pub fn with(hosts: &[&str], mechanism: Mechanism) -> Self {
        static SERIAL: AtomicU32 = AtomicU32::new(0);
        let swept = ns::sweep_stale();
        if !swept.is_empty() {
            eprintln!("netlab: swept {} stale namespaces: {swept:?}", swept.len());
        }
        let serial = SERIAL.fetch_add(1, Ordering::Relaxed);
        let mut made = Vec::new();
        for (i, name) in hosts.iter().enumerate() {
            let ns = Netns::create(serial, name).unwrap_or_else(|e| {
                panic!("netlab needs root and `ip netns` (scripts/netns-check.sh): {e}")
            });
            made.push(Host {
                name: (*name).to_owned(),
                ns,
                addr: Ipv4Addr::new(BASE[0], BASE[1], BASE[2], 10 + i as u8),
            });
        }
        let netem = ns::has_netem(&made[0].ns);
        let use_veth = match mechanism {
            Mechanism::Veth => true,
            Mechanism::Switch => false,
            Mechanism::Auto => match std::env::var("KVMESH_NETLAB_LINKS").as_deref() {
                Ok("veth") => true,
                Ok("switch") => false,
                Ok("") | Err(_) => netem,
                Ok(other) => panic!("KVMESH_NETLAB_LINKS={other:?}: expected switch or veth"),
            },
        };
        let (links, mechanism) = if use_veth {
            let bridge = Netns::create(serial, "bridge")
                .and_then(|ns| veth::Bridge::create(ns, netem))
                .unwrap_or_else(|e| panic!("netlab bridge: {e}"));
            for (i, h) in made.iter().enumerate() {
                bridge
                    .join(i, &h.ns, &format!("{}/24", h.addr))
                    .unwrap_or_else(|e| panic!("netlab veth for {}: {e}", h.name));
            }
            let how = if netem {
                "veth pairs into a bridge, shaped by tc netem (delay, jitter, loss, rate) and tbf"
            } else {
                "veth pairs into a bridge, tbf for rates only (this kernel has no netem)"
            };
            (Links::Veth(bridge), how.to_owned())
        } else {
            let mut tuns = Vec::new();
            for h in &made {
                let fd =
                    h.ns.enter(|| switch::open_tun("lab0"))
                        .unwrap_or_else(|e| panic!("netlab TUN in {}: {e}", h.ns.name));
                let (addr, mtu) = (format!("{}/24", h.addr), switch::MTU.to_string());
                let n = h.ns.name.as_str();
                for a in [
                    vec!["-n", n, "addr", "add", &addr, "dev", "lab0"],
                    vec![
                        "-n",
                        n,
                        "link",
                        "set",
                        "lab0",
                        "mtu",
                        &mtu,
                        "txqueuelen",
                        "1000",
                        "up",
                    ],
                ] {
                    ns::ip(&a).unwrap_or_else(|e| panic!("netlab: {e}"));
                }
                tuns.push(fd);
            }
            let sw = switch::Switch::start(tuns, made.iter().map(|h| h.addr).collect());
            let how = format!(
                "a userspace switch over one TUN per host (MTU {}), in the test process{}",
                switch::MTU,
                if netem {
                    " (asked for; this kernel has netem too)"
                } else {
                    " (this kernel has no netem qdisc)"
                }
            );
            (Links::Switch(sw), how)
        };
        Self {
            links,
            hosts: made,
            mechanism,
        }
    }

    /// What shapes the links, in words.
    pub fn mechanism(&self) -> &str {
        &self.mechanism
    }

    /// The host called `name`.
    pub fn host(&self, name: &str) -> &Host {
        self.hosts
            .iter()
            .find(|h| h.name == name)
            .unwrap_or_else(|| panic!("no lab host {name}"))
    }

    fn index(&self, name: &str) -> usize {
        self.hosts
            .iter()
            .position(|h| h.name == name)
            .unwrap_or_else(|| panic!("no lab host {name}"))
    }

    /// Shapes host `name`'s link.
    pub fn shape(&self, name: &str, s: Shape) {
        let i = self.index(name);
        match &self.links {
            Links::Switch(sw) => sw.shape(i, s),
            Links::Veth(b) => b
                .shape(i, &self.hosts[i].ns, s)
                .unwrap_or_else(|e| panic!("shape {name}: {e}")),
        }
    }

    /// Shapes every host's link alike.
    pub fn shape_all(&self, s: Shape) {
        for h in &self.hosts {
            self.shape(&h.name, s);
        }
    }

    /// Cuts host `name` off (`false`) or joins it again: its link is down
    /// and every packet to or from it vanishes.
    pub fn set_link(&self, name: &str, up: bool) {
        let i = self.index(name);
        match &self.links {
            Links::Switch(sw) => sw.set_up(i, up),
            Links::Veth(b) => b
                .set_up(i, up)
                .unwrap_or_else(|e| panic!("link {name}: {e}")),
        }
    }

    /// The switch's counts for host `name`'s link, when the switch carries
    /// the links (`None` on veth: read `tc -s qdisc` there).
    pub fn link_stats(&self, name: &str) -> Option<switch::LinkStats> {
        match &self.links {
            Links::Switch(sw) => Some(sw.stats(self.index(name))),
            Links::Veth(_) => None,
        }
    }

    /// Bytes host `name`'s lab interface has received and sent so far
    /// (its kernel's counters, whichever mechanism carries the link).
    pub fn interface_bytes(&self, name: &str) -> (u64, u64) {
        let dev = match self.links {
            Links::Switch(_) => "lab0:",
            Links::Veth(_) => "eth0:",
        };
        let text = self.host(name).ns.enter(|| {
            // The calling thread's namespace (/proc/self/net is the
            // process's, which is not the lab's).
            std::fs::read_to_string("/proc/thread-self/net/dev").unwrap_or_default()
        });
        text.lines()
            .find_map(|l| {
                let rest = l.trim().strip_prefix(dev)?;
                let f: Vec<u64> = rest
                    .split_whitespace()
                    .filter_map(|x| x.parse().ok())
                    .collect();
                Some((*f.first()?, *f.get(8)?))
            })
            .unwrap_or_else(|| panic!("no {dev} in {name}'s /proc/net/dev:\n{text}"))
    }

    /// TCP segments host `name`'s kernel has retransmitted so far
    /// (`RetransSegs` of its `/proc/net/snmp`): what loss and partitions
    /// cost its connections.
    pub fn tcp_retransmits(&self, name: &str) -> u64 {
        let text = self
            .host(name)
            .ns
            .enter(|| std::fs::read_to_string("/proc/thread-self/net/snmp").unwrap_or_default());
        let tcp: Vec<Vec<&str>> = text
            .lines()
            .filter(|l| l.starts_with("Tcp:"))
            .map(|l| l.split_whitespace().collect())
            .collect();
        tcp.first()
            .and_then(|h| h.iter().position(|f| *f == "RetransSegs"))
            .and_then(|i| tcp.get(1)?.get(i)?.parse().ok())
            .unwrap_or_else(|| panic!("no RetransSegs in {name}'s /proc/net/snmp"))
    }

    /// The time a TCP connect from host `from` to `to:port` takes (one
    /// round trip), the median of `n` tries: what the links really add.
    pub fn connect_rtt(&self, from: &str, to: &str, port: u16, n: usize) -> Duration {
        let dst = std::net::SocketAddr::from((self.host(to).addr, port));
        let mut times: Vec<Duration> = self.host(from).ns.enter(|| {
            (0..n)
                .filter_map(|_| {
                    let t = std::time::Instant::now();
                    std::net::TcpStream::connect_timeout(&dst, Duration::from_secs(2))
                        .ok()
                        .map(|_| t.elapsed())
                })
                .collect()
        });
        times.sort();
        times
            .get(times.len() / 2)
            .copied()
            .unwrap_or_else(|| panic!("no connection from {from} to {dst}"))
    }
}
