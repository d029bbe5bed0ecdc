//! The lab's links where the kernel has `netem` (or where asked for with
//! `KVMESH_NETLAB_LINKS=veth`): each host's namespace joined to a bridge
//! in a namespace of its own by a veth pair, shaped by qdiscs.
//!
//! A host's shape goes on its own end as it sends (`netem delay J loss P
//! rate R`, or `tbf` for a rate alone), and its rate also on the bridge's
//! end towards it, so two senders to one host share its port, as in
//! [`super::switch`]. A partition takes the bridge's end down: the host's
//! end loses carrier and every packet either way is lost.

use super::ns::{ip, Netns};
use super::Shape;

/// The bridge and the host ends' names on the bridge's side (`p0`, ...).
#[derive(Debug)]
pub struct Bridge {
    /// The namespace holding `br0`; deleted (with every link) on drop.
    pub ns: Netns,
    netem: bool,
}

impl Bridge {
    /// A bridge in `ns`; `netem`: whether this kernel has the qdisc.
    pub fn create(ns: Netns, netem: bool) -> Result<Self, String> {
        ip(&[
            "-n",
            &ns.name,
            "link",
            "add",
            "br0",
            "type",
            "bridge",
            "forward_delay",
            "0",
            "stp_state",
            "0",
        ])?;
        ip(&["-n", &ns.name, "link", "set", "br0", "up"])?;
        Ok(Self { ns, netem })
    }

    /// Joins host `i`'s namespace `host` with `eth0` holding `addr/24`.
    pub fn join(&self, i: usize, host: &Netns, addr: &str) -> Result<(), String> {
        let port = format!("p{i}");
        ip(&[
            "-n",
            &self.ns.name,
            "link",
            "add",
            &port,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            &host.name,
        ])?;
        ip(&["-n", &self.ns.name, "link", "set", &port, "master", "br0"])?;
        ip(&["-n", &self.ns.name, "link", "set", &port, "up"])?;
        ip(&["-n", &host.name, "addr", "add", addr, "dev", "eth0"])?;
        ip(&["-n", &host.name, "link", "set", "eth0", "up"])
    }

    /// Shapes host `i` (namespace `host`): replaces both ends' qdiscs.
    pub fn shape(&self, i: usize, host: &Netns, s: Shape) -> Result<(), String> {
        let port = format!("p{i}");
        let ms = |d: std::time::Duration| format!("{}us", d.as_micros());
        let rate = s.rate_bps.map(|r| format!("{r}bit"));
        let shaped = !s.latency.is_zero() || !s.jitter.is_zero() || s.loss > 0.0;
        let _ = ip(&["-n", &host.name, "link", "set", "eth0", "up"]);
        let _ = host.exec(&["tc", "qdisc", "del", "dev", "eth0", "root"]);
        let _ = self.ns.exec(&["tc", "qdisc", "del", "dev", &port, "root"]);
        if shaped {
            if !self.netem {
                return Err(
                    "latency, jitter or loss asked for, but this kernel has no netem qdisc: \
                     use the TUN switch (KVMESH_NETLAB_LINKS=switch)"
                        .into(),
                );
            }
            let (lat, jit, loss) = (ms(s.latency), ms(s.jitter), format!("{}%", s.loss * 100.0));
            let mut a = vec![
                "tc", "qdisc", "add", "dev", "eth0", "root", "netem", "delay", &lat, &jit, "loss",
                &loss,
            ];
            if let Some(r) = &rate {
                a.extend(["rate", r.as_str()]);
            }
            host.exec(&a)?;
        } else if let Some(r) = &rate {
            host.exec(&tbf("eth0", r))?;
        }
        if let Some(r) = &rate {
            self.ns.exec(&tbf(&port, r))?;
        }
        Ok(())
    }

    /// Takes host `i`'s bridge port down (`false`) or up.
    pub fn set_up(&self, i: usize, up: bool) -> Result<(), String> {
        let port = format!("p{i}");
        ip(&[
            "-n",
            &self.ns.name,
            "link",
            "set",
            &port,
            if up { "up" } else { "down" },
        ])
    }
}

/// `tc` arguments for a token bucket at `rate` on `dev`, holding 20 ms of
/// backlog (the switch's `QUEUE_LIMIT`).
fn tbf<'a>(dev: &'a str, rate: &'a str) -> Vec<&'a str> {
    vec![
        "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "64kb", "latency",
        "20ms",
    ]
}
