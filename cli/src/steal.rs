//! CPU time the hypervisor gave to other tenants ("steal", from Linux's
//! `/proc/stat`): on a shared virtual machine the one sign of a noisy
//! neighbour that the load average does not show. Benchmarks report the
//! share of the run it took, so a reader knows their figures are low by up
//! to that much.

/// The machine's CPU time so far, in clock ticks: all of it, and stolen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuTimes {
    total: u64,
    steal: u64,
}

impl CpuTimes {
    /// Now, from `/proc/stat`; `None` where it is absent or unreadable
    /// (not Linux).
    pub fn now() -> Option<CpuTimes> {
        parse(&std::fs::read_to_string("/proc/stat").ok()?)
    }

    /// The share of the CPU time between `self` and `later` that was
    /// stolen; `None` when no time passed.
    pub fn stolen_until(self, later: CpuTimes) -> Option<f64> {
        let total = later.total.checked_sub(self.total)?;
        let steal = later.steal.checked_sub(self.steal)?;
        (total > 0).then(|| steal as f64 / total as f64)
    }
}

/// The `cpu` line of `/proc/stat`: user, nice, system, idle, iowait, irq,
/// softirq, steal (guest time is inside user already). Kernels before
/// 2.6.11 have no steal column: `None`.
fn parse(stat: &str) -> Option<CpuTimes> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let ticks: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    (ticks.len() == 8).then(|| CpuTimes {
        total: ticks.iter().sum(),
        steal: ticks[7],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_steal_column_over_all_eight() {
        let a = "cpu  100 0 50 800 20 0 5 25 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n";
        let b = "cpu  200 0 60 900 20 0 5 65 0 0\n";
        let (a, b) = (parse(a).expect("a cpu line"), parse(b).expect("a cpu line"));
        assert_eq!(
            a,
            CpuTimes {
                total: 1000,
                steal: 25
            }
        );
        // 40 of the 250 ticks between them were stolen.
        assert_eq!(a.stolen_until(b), Some(40.0 / 250.0));
        assert_eq!(b.stolen_until(a), None, "time does not run backwards");
        assert_eq!(a.stolen_until(a), None, "no time passed");
        assert_eq!(parse("cpu  1 2 3 4 5 6 7\n"), None, "no steal column");
        assert_eq!(parse("intr 5\n"), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_machine_has_a_cpu_line() {
        let a = CpuTimes::now().expect("/proc/stat's cpu line");
        let busy = std::time::Instant::now();
        while busy.elapsed() < std::time::Duration::from_millis(200) {
            std::hint::black_box(0u64);
        }
        let share = a
            .stolen_until(CpuTimes::now().expect("again"))
            .expect("time passed");
        assert!((0.0..=1.0).contains(&share), "{share}");
    }
}
