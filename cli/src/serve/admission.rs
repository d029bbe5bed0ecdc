//! `kvmesh serve`'s admission flags: the router's slots and queue, the
//! policy, and tenants' shares in their flag form.

use anyhow::Result;
use clap::Args;

/// `kvmesh serve`'s admission: slots, queue, policy, tenants' shares
/// (the mesh file's `router.max_running`, `max_queued`, `admission` and
/// each key's `weight`, `max_running`, `max_queued_tokens`).
#[derive(Args, Debug, Clone)]
pub struct AdmissionArgs {
    /// Choices dispatched at once (a request with n: 16 holds 16).
    #[arg(long, env = "KVMESH_MAX_RUNNING", default_value_t = 64)]
    pub max_running: usize,
    /// Choices waiting for a slot at most; more get 429.
    #[arg(long, env = "KVMESH_MAX_QUEUED", default_value_t = 256)]
    pub max_queued: usize,
    /// How waiting requests are served: fair (per-tenant queues; the
    /// tenant running the fewest slots per unit of weight goes next) or
    /// fifo (arrival order).
    #[arg(long, env = "KVMESH_ADMISSION", default_value = "fair")]
    pub admission: kvmesh_router::admission::Policy,
    /// Slots only a tenant running nothing may take (fair admission), so
    /// another tenant's first request starts at once; 0: work-conserving.
    /// Default: an eighth of --max-running where the API keys name more
    /// than one tenant, else 0.
    #[arg(long, env = "KVMESH_RESERVE")]
    pub reserve: Option<usize>,
    /// A tenant's share, TENANT:weight=W:max_running=N:max_queued_tokens=T
    /// (any of the fields; repeat for more tenants; in the environment,
    /// comma-separated); TENANT `*`: the default of every tenant, which a
    /// tenant's own fields override. Default: weight 1, no cap of its own.
    #[arg(
        long = "tenant-share",
        env = "KVMESH_TENANT_SHARES",
        value_delimiter = ','
    )]
    pub tenant_shares: Vec<String>,
}

impl AdmissionArgs {
    /// The tenants' shares, parsed.
    pub(super) fn shares(&self) -> Result<kvmesh_router::admission::Shares> {
        anyhow::ensure!(self.max_running > 0, "--max-running must be at least 1");
        if let Some(r) = self.reserve {
            use kvmesh_router::admission::{check_reserve, BadReserve};
            check_reserve(self.admission, r, self.max_running).map_err(|e| match e {
                BadReserve::Fifo => anyhow::anyhow!(
                    "--reserve is fair admission's; --admission fifo keeps no slot back"
                ),
                BadReserve::NotUnderSlots => anyhow::anyhow!(
                    "--reserve {r}: must be under --max-running ({})",
                    self.max_running
                ),
            })?;
        }
        use kvmesh_router::admission::{Share, Shares};
        let mut parsed = Vec::new();
        for s in &self.tenant_shares {
            let (tenant, fields) = s
                .split_once(':')
                .filter(|(t, _)| !t.is_empty())
                .ok_or_else(|| {
                    anyhow::anyhow!("--tenant-share {s:?}: expected TENANT:FIELD=N[:FIELD=N]")
                })?;
            // Checked alone first, so a bad field is named in its own value.
            Share::parse_fields(fields)
                .map_err(|e| anyhow::anyhow!("--tenant-share {s:?}: {e}"))?;
            parsed.push((tenant, fields));
        }
        // `*` first: the others' fields go over it.
        let default = parsed
            .iter()
            .filter(|(t, _)| *t == "*")
            .map(|(_, f)| *f)
            .collect::<Vec<_>>()
            .join(":");
        let mut shares = Shares::default();
        shares.set_default(Share::parse_fields(&default).map_err(anyhow::Error::msg)?);
        for (tenant, fields) in parsed.into_iter().filter(|(t, _)| *t != "*") {
            let share =
                Share::parse_fields(&format!("{default}:{fields}")).map_err(anyhow::Error::msg)?;
            shares
                .set(tenant, share)
                .map_err(|e| anyhow::anyhow!("--tenant-share: {e}"))?;
        }
        Ok(shares)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_router::admission::Share;
    use kvmesh_router::auth::Tenant;

    fn args(shares: &[&str]) -> AdmissionArgs {
        AdmissionArgs {
            max_running: 64,
            max_queued: 256,
            admission: kvmesh_router::admission::Policy::Fair,
            reserve: None,
            tenant_shares: shares.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    #[test]
    fn tenant_shares_parse_with_the_default_under_each_tenants_own() {
        let shares = args(&["a:weight=2", "*:max_running=48", "b:max_running=64"])
            .shares()
            .expect("valid");
        let of = |t: &str| shares.of(&Tenant(t.into()));
        let parsed = |f: &str| Share::parse_fields(f).expect("share");
        assert_eq!(of("a"), parsed("weight=2:max_running=48"));
        assert_eq!(of("b"), parsed("max_running=64"));
        assert_eq!(of("z"), parsed("max_running=48"));
        for (bad, says) in [
            ("a", "expected TENANT:FIELD=N"),
            (":weight=2", "expected TENANT:FIELD=N"),
            ("a:weight=0", "weight = 0"),
            ("a:speed=1", "unknown field"),
        ] {
            let e = args(&[bad]).shares().expect_err(bad).to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
        let e = args(&["a:weight=2", "a:weight=3"])
            .shares()
            .expect_err("two");
        assert!(e.to_string().contains("two different limits"), "{e}");
        let mut zero = args(&[]);
        zero.max_running = 0;
        assert!(zero.shares().is_err());
        let mut all = args(&[]);
        all.reserve = Some(64);
        let e = all.shares().expect_err("the whole").to_string();
        assert!(
            e.contains("--reserve 64: must be under --max-running (64)"),
            "{e}"
        );
        all.reserve = Some(63);
        assert!(all.shares().is_ok());
        all.admission = kvmesh_router::admission::Policy::Fifo;
        let e = all.shares().expect_err("fifo").to_string();
        assert!(e.contains("fifo keeps no slot back"), "{e}");
    }
}
