//! Which UCX transports may carry KV, and how: the `UCX_TLS` kvmesh allows
//! (no shared memory: an endpoint close does not fence its copies),
//! whether this host may put at all (only over an RDMA device), and which
//! lanes an endpoint's puts may use (those a forced close is known to
//! fence; ARCHITECTURE.md has the table).

use crate::error::UcxError;

/// Whether one-sided puts may run on this host: only over an RDMA device
/// (`/sys/class/infiniband` lists one: InfiniBand or RoCE). Elsewhere UCX
/// would emulate puts in software (its `tcp` transport), and that
/// emulation writes wherever a put says, before any kvmesh check, for any
/// peer that reaches the worker: so without an RDMA device a context asks
/// for no RMA at all, a target registers nothing for remote write, and
/// the pages go as active messages the target lands itself, within the
/// bound key's pages (`DataPath::Messages`). `KVMESH_UCX_RMA=off` turns
/// RMA off on an RDMA host too.
pub fn rma_possible() -> bool {
    if std::env::var("KVMESH_UCX_RMA").is_ok_and(|v| v == "off") {
        return false;
    }
    std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some())
}

/// The transports kvmesh lets UCX use unless `UCX_TLS` says otherwise: all
/// but shared memory, whose one-sided copies (cma, xpmem, knem, posix) an
/// endpoint close does not fence. Same-host writers have kvmesh's own shm
/// transport.
pub const DEFAULT_TLS: &str = "^sm";

/// Refuses a `UCX_TLS` value that lets UCX use a shared-memory transport.
pub(crate) fn check_tls(value: &str) -> Result<(), UcxError> {
    const SHARED: [&str; 9] = [
        "all", "sm", "shm", "mm", "posix", "sysv", "cma", "knem", "xpmem",
    ];
    let bad = |t: &str| UcxError::UnsafeTransport {
        value: value.to_owned(),
        transport: t.to_owned(),
    };
    if let Some(excluded) = value.strip_prefix('^') {
        let ex: Vec<&str> = excluded.split(',').map(str::trim).collect();
        if ex.contains(&"sm") || ex.contains(&"shm") {
            return Ok(());
        }
        return Err(bad("shared memory (an exclusion list must exclude sm)"));
    }
    for t in value.split(',').map(str::trim) {
        // `tcp`, `rc`, `rc_x`, `ud`, `dc`, `self`, ...; aliases with a
        // suffix (`posix:aux`) count by their name.
        let name = t.split(':').next().unwrap_or(t);
        if SHARED.contains(&name) {
            return Err(bad(t));
        }
    }
    Ok(())
}

/// From `ucp_ep_print_info`'s lane table (`lane[1]:  1:tcp/lo.0 md[1] ->
/// ... rma_bw#0 am am_bw#0 wireup`): whether there is an RMA lane and every
/// one is a transport whose writes an endpoint close is known to fence
/// ([`FENCED_BY_CLOSE`]). Any other (`tcp`'s software puts, a transport
/// this list does not name) is refused, not assumed.
pub(crate) fn hardware_rma(info: &str) -> bool {
    let rma: Vec<&str> = info
        .lines()
        .filter(|l| l.contains("lane[") && l.contains("rma"))
        .collect();
    !rma.is_empty()
        && rma
            .iter()
            .all(|l| lane_transport(l).is_some_and(fenced_by_close))
}

/// The transports kvmesh puts over: InfiniBand/RoCE reliable connections
/// (`rc_verbs`, `rc_mlx5`) and dynamically connected ones (`dc_mlx5`). A
/// forced close in peer error mode destroys the endpoint's queue pair;
/// the HCA NAKs any RDMA write that reaches a QP in error or reset, so no
/// byte lands after the close completes. `ud` has no RMA; `tcp` emulates
/// puts in software (not used: `rma_possible`); shared-memory transports
/// (`posix`, `sysv`, `cma`, `knem`, `xpmem`) copy without any endpoint in
/// the way and are refused outright (`check_tls`).
pub(crate) const FENCED_BY_CLOSE: [&str; 3] = ["rc_verbs", "rc_mlx5", "dc_mlx5"];

fn fenced_by_close(transport: &str) -> bool {
    FENCED_BY_CLOSE.contains(&transport)
}

/// The transport of a lane line: `3:rc_mlx5/mlx5_0:1` -> `rc_mlx5`.
fn lane_transport(line: &str) -> Option<&str> {
    let after = line.split("]:").nth(1)?.trim_start();
    let (_, rest) = after.split_once(':')?;
    rest.split('/').next()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_values_that_allow_shared_memory_are_refused() {
        for ok in [
            "tcp",
            "rc,tcp",
            "rc_x,ud_x",
            "^sm",
            "^sm,ud",
            "^shm",
            "tcp,self",
        ] {
            assert!(check_tls(ok).is_ok(), "{ok}");
        }
        for bad in [
            "all", "sm,tcp", "tcp,cma", "posix", "^ud", "xpmem", "tcp,knem", "sysv",
        ] {
            let e = check_tls(bad).expect_err(bad);
            assert_eq!(e.kind(), "ucx_unsafe_transport", "{bad}");
        }
    }

    #[test]
    fn only_non_tcp_rma_lanes_count_as_hardware_rma() {
        // What UCX 1.13 printed here for a client-server endpoint over tcp.
        let tcp = "#                 lane[0]: cm rdmacm\n\
                   #                 lane[1]:  1:tcp/lo.0 md[1]  -> md[1]/tcp/sysdev[255] rma_bw#0 am am_bw#0 wireup\n\
                   #                 lane[2]:  2:tcp/eth0.0 md[1] -> md[1]/tcp/sysdev[255] rma_bw#1\n\
                   #                  rma_bw: mds [1] rndv_rkey_size 10\n";
        assert!(!hardware_rma(tcp));
        let ib =
            "#  lane[0]:  3:rc_mlx5/mlx5_0:1 md[2] -> md[2]/ib/sysdev[255] rma_bw#0 am am_bw#0\n\
                  #  lane[1]:  5:ud_mlx5/mlx5_0:1 md[2] -> md[2]/ib/sysdev[255] wireup\n";
        assert!(hardware_rma(ib));
        let mixed = "#  lane[0]:  3:rc_mlx5/mlx5_0:1 md[2] -> md[2]/ib rma_bw#0 am\n\
                     #  lane[1]:  1:tcp/eth0.0 md[1] -> md[1]/tcp rma_bw#1\n";
        assert!(!hardware_rma(mixed));
        assert!(!hardware_rma(
            "#  lane[0]:  1:tcp/lo.0 md[1] -> md[1]/tcp am am_bw#0\n"
        ));
        // A transport the list does not name is refused, not assumed.
        assert!(!hardware_rma(
            "#  lane[0]:  4:gga_mlx5/mlx5_0:1 md[2] -> md[2]/ib rma_bw#0 am\n"
        ));
        let dc = "#  lane[0]:  4:dc_mlx5/mlx5_0:1 md[2] -> md[2]/ib rma_bw#0 am\n";
        assert!(hardware_rma(dc));
    }
}
