//! Model checks of the KV reservation and abort handshake
//! (`kvmesh_kvxfer::protocol_model`, whose docs state the model, its
//! bounds and what each property means).
//!
//! - The protocol as designed satisfies properties A, B and C (I1, I2, I4,
//!   I5, I7) and D (every reservation ends) on both transports, under loss,
//!   duplication, reordering, writer crashes, aborts and timeouts, with a
//!   pool that forces reuse: every reachable state is explored.
//! - Each [`Bug`] makes the checker find a counterexample to the property
//!   it breaks; where a bug lets a late write through, the test also
//!   demands the actual foreign read (A), not only the broken rule (B).
//!
//! Each check prints its state count, depth and time, and each bug its
//! counterexample (`cargo test ... -- --nocapture` to see them). Every check
//! runs single-threaded; the harness runs the tests in parallel.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use kvmesh_kvxfer::protocol_model::{
    Action, Bug, HandshakeModel, Scenario, State, Transport, ALL_END, ENDS_ONCE, NO_LATE_WRITES,
    SAFE_READS,
};
use stateright::{Checker, Expectation, HasDiscoveries, Model};

const ONE_SIDED: Transport = Transport::OneSided;
const CHECKED: Transport = Transport::ReceiverChecked;

/// No single check may take longer: the file must stay well under a
/// minute on two busy cores (the largest check takes about 6 s alone).
const LIMIT: Duration = Duration::from_secs(40);

/// What a run saw: the properties that have a discovery.
struct Run {
    found: BTreeSet<&'static str>,
}

/// Explores `scenario` breadth-first, until every state is seen or, with
/// `stop_when` set, until each of those properties has a discovery (the
/// early stop also keeps the reported counterexample short: stateright
/// replaces a property's discovery with later ones while it runs). Prints
/// the counts, and the path to each expected discovery.
fn check(label: &str, scenario: Scenario, stop_when: &[&'static str]) -> Run {
    let model = HandshakeModel::new(scenario).expect("valid scenario");
    let mut builder = model.checker().timeout(LIMIT);
    if !stop_when.is_empty() {
        let names: BTreeSet<&'static str> = stop_when.iter().copied().collect();
        builder = builder.finish_when(HasDiscoveries::AllOf(names));
    }
    let start = Instant::now();
    let checker = builder.spawn_bfs().join();
    let elapsed = start.elapsed();
    let discoveries = checker.discoveries();
    eprintln!(
        "{label}: {} unique states ({} generated), depth {}, {:.2?}",
        checker.unique_state_count(),
        checker.state_count(),
        checker.max_depth(),
        elapsed,
    );
    for name in stop_when {
        if let Some(path) = discoveries.get(name) {
            print_counterexample(checker.model(), name, path.clone().into_vec());
        }
    }
    assert!(
        elapsed < LIMIT,
        "{label}: the check hit its time limit; shrink the scenario"
    );
    if stop_when.is_empty() {
        // No counterexample to A-D, an example of each sanity property,
        // and every reachable state explored.
        checker.assert_properties();
    }
    Run {
        found: discoveries.keys().copied().collect(),
    }
}

/// Prints the steps of a counterexample. An `always` one is cut at its
/// first violating state: stateright reports some violating path, which
/// may run on past the violation.
fn print_counterexample(
    model: &HandshakeModel,
    name: &'static str,
    path: Vec<(State, Option<Action>)>,
) {
    let property = model.property(name);
    eprintln!("  counterexample to {name}:");
    for (state, action) in path {
        if property.expectation == Expectation::Always && !(property.condition)(model, &state) {
            eprintln!("    (violated here)");
            return;
        }
        if let Some(action) = action {
            eprintln!("    {action:?}");
        }
    }
}

/// Asserts that the checker finds a counterexample to each of `expected`.
fn finds(label: &str, scenario: Scenario, expected: &[&'static str]) {
    let run = check(label, scenario, expected);
    for name in expected {
        assert!(
            run.found.contains(name),
            "{label}: expected a counterexample to {name:?}, found {:?}",
            run.found
        );
    }
}

// The protocol as designed.

#[test]
fn one_sided_protocol_is_safe_and_ends_under_faults() {
    check(
        "one-sided, standard",
        Scenario::standard(ONE_SIDED, Bug::None),
        &[],
    );
}

#[test]
fn receiver_checked_protocol_is_safe_and_ends_under_faults() {
    check(
        "receiver-checked, standard",
        Scenario::standard(CHECKED, Bug::None),
        &[],
    );
}

#[test]
fn handshake_alone_ends_every_reservation_with_fair_delivery() {
    check(
        "one-sided, fair delivery, no timeouts",
        Scenario::fair_delivery(ONE_SIDED, Bug::None),
        &[],
    );
    check(
        "receiver-checked, fair delivery, no timeouts",
        Scenario::fair_delivery(CHECKED, Bug::None),
        &[],
    );
}

#[test]
fn partly_filled_pages_are_safe() {
    check(
        "one-sided, partial pages",
        Scenario::partial_pages(ONE_SIDED, Bug::None),
        &[],
    );
    check(
        "receiver-checked, partial pages",
        Scenario::partial_pages(CHECKED, Bug::None),
        &[],
    );
}

// Each bug is found, by the property it breaks.

#[test]
fn free_on_timeout_is_found() {
    finds(
        "one-sided, free on timeout",
        Scenario::standard(ONE_SIDED, Bug::FreeOnTimeout),
        &[NO_LATE_WRITES, SAFE_READS],
    );
}

/// Over TCP the same bug breaks I5's rule (B), but D's check on arrival
/// refuses the late frames, so no read ever sees foreign data (A holds on
/// every reachable state). The crash is left out to keep this full
/// exploration small; the loss, duplicate, aborts and timeouts stay.
#[test]
fn receiver_check_contains_free_on_timeout() {
    let mut scenario = Scenario::standard(CHECKED, Bug::FreeOnTimeout);
    scenario.faults.crashes = 0;
    let label = "receiver-checked, free on timeout, no crash";
    let run = check(label, scenario.clone(), &[NO_LATE_WRITES]);
    assert!(run.found.contains(NO_LATE_WRITES));
    let model = HandshakeModel::new(scenario).expect("valid scenario");
    let start = Instant::now();
    let full = model.checker().timeout(LIMIT).spawn_bfs().join();
    eprintln!(
        "{label}, full: {} unique states, {:.2?}",
        full.unique_state_count(),
        start.elapsed()
    );
    assert!(full.is_done());
    full.assert_no_discovery(SAFE_READS);
    full.assert_no_discovery(ENDS_ONCE);
    full.assert_no_discovery(ALL_END);
}

#[test]
fn free_on_abort_without_confirm_is_found() {
    finds(
        "one-sided, free on abort without confirm",
        Scenario::standard(ONE_SIDED, Bug::FreeOnAbortWithoutConfirm),
        &[NO_LATE_WRITES, SAFE_READS],
    );
}

/// A lost frame leaves a slot unwritten; without I4's check the sequence
/// goes live and reads it. Both transports.
#[test]
fn skipped_verification_is_found() {
    for transport in [ONE_SIDED, CHECKED] {
        finds(
            &format!("{transport:?}, skip verification"),
            Scenario::standard(transport, Bug::SkipVerification),
            &[SAFE_READS],
        );
    }
}

#[test]
fn confirm_before_drain_is_found() {
    finds(
        "one-sided, confirm before drain",
        Scenario::fair_delivery(ONE_SIDED, Bug::ConfirmBeforeDrain),
        &[NO_LATE_WRITES, SAFE_READS],
    );
}

/// Completion frees without a confirmation, so a Done sent with a write
/// still in flight lets that write land in the next owner's page.
#[test]
fn done_before_drain_is_found() {
    finds(
        "one-sided, done before drain",
        Scenario::fair_delivery(ONE_SIDED, Bug::DoneBeforeDrain),
        &[NO_LATE_WRITES, SAFE_READS],
    );
}

/// The abort overtakes the grant; a writer that confirms without a
/// tombstone starts writing when the grant arrives, after the pages moved.
#[test]
fn missing_abort_tombstone_is_found() {
    finds(
        "one-sided, no abort tombstone",
        Scenario::fair_delivery(ONE_SIDED, Bug::NoAbortTombstone),
        &[NO_LATE_WRITES, SAFE_READS],
    );
}

#[test]
fn release_on_late_confirm_is_found() {
    finds(
        "one-sided, release on late confirm",
        Scenario::fair_delivery(ONE_SIDED, Bug::ReleaseOnLateConfirm),
        &[ENDS_ONCE],
    );
}

/// Liveness: an abort that crosses the writer's Done is never confirmed,
/// and without timeouts the reservation never ends. With timeouts the same
/// bug is masked (the lease revokes and frees; the full exploration below
/// finds no counterexample to anything), which is why D is checked without
/// them. The crash is left out of that exploration to keep it small.
#[test]
fn ignored_abort_after_done_is_found_without_timeouts() {
    for transport in [ONE_SIDED, CHECKED] {
        finds(
            &format!("{transport:?}, ignore abort after done, fair delivery"),
            Scenario::fair_delivery(transport, Bug::IgnoreAbortAfterDone),
            &[ALL_END],
        );
    }
    let mut masked = Scenario::standard(ONE_SIDED, Bug::IgnoreAbortAfterDone);
    masked.faults.crashes = 0;
    check(
        "one-sided, ignore abort after done, with timeouts",
        masked,
        &[],
    );
}
