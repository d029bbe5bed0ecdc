//! kvmesh fault injection and planted bugs, for the fault-matrix, leak and
//! soak tests. The types always exist (so the services carry a plan without
//! `cfg` noise) but every hook is inert unless this crate is built with the
//! `testing` feature (which the test build turns on through
//! `kvmesh-kvpool/testing`): [`FaultPlan::at`] then always answers `None` and
//! [`planted`] always `false`, which the optimiser folds away. Release
//! builds (`cargo build --release -p kvmesh-cli`) do not enable it.
//!
//! # A request's faults
//! A test names them in the gateway header [`HEADER`] (honoured only by a
//! router started with `--fault-injection` in a testing build); the router
//! forwards the same text to the decode and prefill nodes in gRPC metadata
//! of the same name. The grammar is `RULE[,RULE...]`, `RULE =
//! POINT=ACTION`, one rule per point:
//!
//! | point      | where                    | actions                                      |
//! |------------|--------------------------|----------------------------------------------|
//! | `reserve`  | router -> decode Generate | drop, delay:MS, duplicate                   |
//! | `grant`    | decode -> router -> prefill | drop (at decode), delay:MS, duplicate, corrupt |
//! | `frame:N`  | prefill's Nth page write | drop, delay:MS, duplicate, reorder, corrupt, crash |
//! | `done`     | prefill's transfer-done  | drop, delay:MS, duplicate, reorder, corrupt, crash |
//! | `verify`   | decode, before I4 checks | corrupt (a landed value)                     |
//! | `step:N`   | decode step N of the sequence | drop (cut the stream), delay:MS, corrupt (page table), crash |
//! | `abort`    | decode, when the router drops its stream | drop, delay:MS, duplicate     |
//! | `confirm`  | prefill's AbortConfirmed | drop (withhold), delay:MS, duplicate         |
//! | `release`  | decode, sequence end     | delay:MS (pages held longer)                 |
//!
//! `reorder` of a frame swaps it with its neighbour in the same layer; of
//! `done`, it sends the transfer's last frame after transfer-done.
//! `crash` aborts the process at that point.
//!
//! # The catalogue
//! [`CATALOG`] lists the specs the fault matrix and the soak inject, each
//! with its [`Expect`]ed outcome: one table, so the two cannot disagree.
//!
//! # Planted bugs
//! [`plant`] switches off one defence for the whole process (a test flag
//! of the services): the router's admission check, decode's transfer
//! verification, or confirm-or-revoke on abort. The tests show that the
//! next defence still holds.

#![deny(missing_docs)]

pub mod catalog;

pub use catalog::{Entry, Expect, CATALOG};

use std::fmt;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

/// The gateway header and gRPC metadata key that carry a request's faults.
pub const HEADER: &str = "x-kvmesh-fault";

/// Longest delay a rule may ask for.
pub const MAX_DELAY: Duration = Duration::from_secs(30);

/// Whether this build honours fault plans and planted bugs.
pub const fn enabled() -> bool {
    cfg!(feature = "testing")
}

/// A step of the handshake or of decoding where a fault can be injected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Point {
    /// The router's Generate call (the reservation it asks for).
    Reserve,
    /// The grant on its way from decode through the router to prefill.
    Grant,
    /// The writer's Nth page write (0-based, over the whole transfer).
    Frame(u32),
    /// Transfer-done.
    Done,
    /// Decode's I4 verification.
    Verify,
    /// The sequence's Nth decode step (0-based).
    Step(u32),
    /// The abort of a reservation whose stream the router dropped.
    Abort,
    /// The writer's abort confirmation.
    Confirm,
    /// The release of a finished sequence's pages.
    Release,
}

impl fmt::Display for Point {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Reserve => f.write_str("reserve"),
            Self::Grant => f.write_str("grant"),
            Self::Frame(n) => write!(f, "frame:{n}"),
            Self::Done => f.write_str("done"),
            Self::Verify => f.write_str("verify"),
            Self::Step(n) => write!(f, "step:{n}"),
            Self::Abort => f.write_str("abort"),
            Self::Confirm => f.write_str("confirm"),
            Self::Release => f.write_str("release"),
        }
    }
}

/// What happens at a point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// The message is lost.
    Drop,
    /// The message goes late.
    Delay(Duration),
    /// The message goes twice.
    Duplicate,
    /// The message changes places with a neighbour.
    Reorder,
    /// The message (or the data it stands for) is damaged.
    Corrupt,
    /// The process dies here.
    Crash,
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Drop => f.write_str("drop"),
            Self::Delay(d) => write!(f, "delay:{}", d.as_millis()),
            Self::Duplicate => f.write_str("duplicate"),
            Self::Reorder => f.write_str("reorder"),
            Self::Corrupt => f.write_str("corrupt"),
            Self::Crash => f.write_str("crash"),
        }
    }
}

/// Why a fault spec was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("fault spec {rule:?}: {reason}")]
pub struct FaultSpecError {
    /// The offending rule.
    pub rule: String,
    /// What is wrong with it.
    pub reason: String,
}

/// A request's faults: at most one action per point.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FaultPlan {
    rules: Vec<(Point, Action)>,
}

impl FaultPlan {
    /// No faults.
    pub fn none() -> Self {
        Self::default()
    }

    /// Parses `POINT=ACTION[,POINT=ACTION...]` (see the module docs);
    /// refuses unknown points and actions, actions a point does not
    /// support, a point named twice, and more than 16 rules.
    pub fn parse(spec: &str) -> Result<Self, FaultSpecError> {
        let mut rules = Vec::new();
        for rule in spec.split(',').map(str::trim).filter(|r| !r.is_empty()) {
            let err = |reason: &str| FaultSpecError {
                rule: rule.chars().take(64).collect(),
                reason: reason.to_owned(),
            };
            if rules.len() == 16 {
                return Err(err("at most 16 rules"));
            }
            let (p, a) = rule
                .split_once('=')
                .ok_or_else(|| err("expected POINT=ACTION"))?;
            let point = parse_point(p.trim()).map_err(|r| err(&r))?;
            let action = parse_action(a.trim()).map_err(|r| err(&r))?;
            if !supported(point, action) {
                return Err(err(&format!("{point} does not support {action}")));
            }
            if rules.iter().any(|(q, _)| *q == point) {
                return Err(err("point named twice"));
            }
            rules.push((point, action));
        }
        Ok(Self { rules })
    }

    /// The plan a request carries in header or metadata [`HEADER`]:
    /// none when absent or in a build without fault injection (which
    /// ignores the header entirely).
    pub fn from_header(value: Option<&str>) -> Result<Self, FaultSpecError> {
        match value {
            Some(v) if enabled() => Self::parse(v),
            _ => Ok(Self::none()),
        }
    }

    /// No rule at all.
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// The action at `point`, in a testing build; always `None` otherwise.
    #[inline]
    pub fn at(&self, point: Point) -> Option<Action> {
        if !enabled() {
            return None;
        }
        self.rules
            .iter()
            .find(|(p, _)| *p == point)
            .map(|(_, a)| *a)
    }
}

impl fmt::Display for FaultPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (p, a)) in self.rules.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{p}={a}")?;
        }
        Ok(())
    }
}

fn parse_point(s: &str) -> Result<Point, String> {
    let indexed = |rest: &str| {
        rest.parse::<u32>()
            .map_err(|_| format!("{s}: expected a number after ':'"))
    };
    Ok(match s.split_once(':') {
        Some(("frame", n)) => Point::Frame(indexed(n)?),
        Some(("step", n)) => Point::Step(indexed(n)?),
        Some(_) => return Err(format!("unknown point {s}")),
        None => match s {
            "reserve" => Point::Reserve,
            "grant" => Point::Grant,
            "done" => Point::Done,
            "verify" => Point::Verify,
            "abort" => Point::Abort,
            "confirm" => Point::Confirm,
            "release" => Point::Release,
            "frame" | "step" => return Err(format!("{s} needs an index: {s}:N")),
            _ => return Err(format!("unknown point {s}")),
        },
    })
}

fn parse_action(s: &str) -> Result<Action, String> {
    Ok(match s.split_once(':') {
        Some(("delay", ms)) => {
            let ms: u64 = ms
                .parse()
                .map_err(|_| "delay:MS needs milliseconds".to_owned())?;
            let d = Duration::from_millis(ms);
            if d > MAX_DELAY {
                return Err(format!("delay above {} ms", MAX_DELAY.as_millis()));
            }
            Action::Delay(d)
        }
        Some(_) => return Err(format!("unknown action {s}")),
        None => match s {
            "drop" => Action::Drop,
            "duplicate" => Action::Duplicate,
            "reorder" => Action::Reorder,
            "corrupt" => Action::Corrupt,
            "crash" => Action::Crash,
            "delay" => return Err("delay needs a duration: delay:MS".into()),
            _ => return Err(format!("unknown action {s}")),
        },
    })
}

/// Which actions each point implements (the table in the module docs).
fn supported(point: Point, action: Action) -> bool {
    use Action::*;
    match point {
        Point::Reserve | Point::Abort | Point::Confirm => {
            matches!(action, Drop | Delay(_) | Duplicate)
        }
        Point::Grant => matches!(action, Drop | Delay(_) | Duplicate | Corrupt),
        Point::Frame(_) | Point::Done => true,
        Point::Verify => matches!(action, Corrupt),
        Point::Step(_) => matches!(action, Drop | Delay(_) | Corrupt | Crash),
        Point::Release => matches!(action, Delay(_)),
    }
}

/// Ends the process at `point` (an injected crash): no unwinding, no
/// destructors, as a killed process.
pub fn crash(point: Point) -> ! {
    eprintln!("kvmesh: injected crash at {point}");
    std::process::abort()
}

/// A defence a test can switch off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlantedBug {
    /// The router admits every request (no context or capacity check).
    NoAdmission,
    /// Decode goes live on transfer-done without the I4 checks.
    NoVerification,
    /// Decode frees an aborted reservation's pages at once, without the
    /// writer's confirmation and without revoking its path.
    NoConfirmOrRevoke,
    /// For measuring what the checks cost (`kvmesh bench --safety both`):
    /// KV reads skip the generation (I1) and watermark (I2) checks and the
    /// poison scan, writers compute no page checksums, and decode goes live
    /// without the I4 verification. The range and owner checks stay: memory
    /// safety rests on them.
    NoKvChecks,
    /// The prefix cache hands out its pages without counting the leases,
    /// so eviction can take a page a sequence still reads: I1's generation
    /// and owner checks must refuse those reads.
    CacheNoLeaseCheck,
    /// The gateway derives every tenant's cache namespace alike (the
    /// tenant is dropped, as a salt plumbing bug would): tenants share
    /// cache entries.
    CacheNoNamespace,
}

impl PlantedBug {
    /// Every bug, with its flag name.
    pub const ALL: [(Self, &'static str); 6] = [
        (Self::NoAdmission, "no-admission"),
        (Self::NoVerification, "no-verification"),
        (Self::NoConfirmOrRevoke, "no-confirm-or-revoke"),
        (Self::NoKvChecks, "no-kv-checks"),
        (Self::CacheNoLeaseCheck, "cache-no-lease-check"),
        (Self::CacheNoNamespace, "cache-no-namespace"),
    ];

    /// By flag name.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.iter().find(|(_, n)| *n == name).map(|(b, _)| *b)
    }

    fn bit(self) -> u8 {
        match self {
            Self::NoAdmission => 1,
            Self::NoVerification => 2,
            Self::NoConfirmOrRevoke => 4,
            Self::NoKvChecks => 8,
            Self::CacheNoLeaseCheck => 16,
            Self::CacheNoNamespace => 32,
        }
    }
}

static PLANTED: AtomicU8 = AtomicU8::new(0);

/// Plants `bug` in this process. Refused in a build without fault
/// injection.
pub fn plant(bug: PlantedBug) -> Result<(), NotAvailable> {
    if !enabled() {
        return Err(NotAvailable);
    }
    eprintln!("kvmesh: PLANTED BUG {bug:?}: a defence is switched off (testing build)");
    PLANTED.fetch_or(bug.bit(), Ordering::SeqCst);
    Ok(())
}

/// Whether `bug` is planted (always `false` outside testing builds).
#[inline]
pub fn planted(bug: PlantedBug) -> bool {
    enabled() && PLANTED.load(Ordering::Relaxed) & bug.bit() != 0
}

/// Fault injection was asked of a build without it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("this build has no fault injection: build kvmesh-cli with `--features fault-injection` (the test build, `cargo build --workspace --all-targets`, has it)")]
pub struct NotAvailable;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_back() {
        let spec = "reserve=delay:50,frame:3=corrupt,done=reorder,step:2=drop,confirm=drop";
        let plan = FaultPlan::parse(spec).expect("valid spec");
        assert_eq!(plan.to_string(), spec);
        if enabled() {
            assert_eq!(plan.at(Point::Frame(3)), Some(Action::Corrupt));
            assert_eq!(plan.at(Point::Frame(2)), None);
            assert_eq!(
                plan.at(Point::Reserve),
                Some(Action::Delay(Duration::from_millis(50)))
            );
        } else {
            assert_eq!(plan.at(Point::Frame(3)), None);
        }
    }

    #[test]
    fn refuses_what_it_cannot_do() {
        for bad in [
            "frame=drop",
            "step:x=drop",
            "verify=drop",
            "release=crash",
            "reserve=corrupt",
            "done=explode",
            "done",
            "delay:10=done",
            "done=delay",
            "done=delay:99999999",
            "done=drop,done=delay:1",
        ] {
            let e = FaultPlan::parse(bad).expect_err(bad);
            assert!(!e.reason.is_empty(), "{bad}");
        }
        let many = (0..17)
            .map(|i| format!("frame:{i}=drop"))
            .collect::<Vec<_>>();
        assert!(FaultPlan::parse(&many.join(",")).is_err());
        assert!(FaultPlan::parse("").expect("empty spec").is_empty());
    }

    #[test]
    fn planted_bugs_by_name() {
        for (bug, name) in PlantedBug::ALL {
            assert_eq!(PlantedBug::from_name(name), Some(bug));
        }
        assert_eq!(PlantedBug::from_name("no-tests"), None);
    }
}
