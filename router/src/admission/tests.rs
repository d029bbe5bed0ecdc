//! The scheduler's decisions on the plain state (every invariant checked
//! after every operation), then the lock-and-channel wrapper: permits
//! that wake the right waiter, time-outs, cancellation, a drain.

use std::num::{NonZeroU32, NonZeroUsize};
use std::time::Duration;

use proptest::prelude::*;
use tokio::sync::mpsc;

use super::state::{Admit, Outcome, State, WaiterId};
use super::*;
use crate::error::ShareLimit;

fn tenant(name: &str) -> Tenant {
    Tenant(name.into())
}

fn fair(slots: usize, max_queued: usize) -> State {
    State::new(slots, max_queued, Policy::Fair, 0, Shares::default())
}

/// Enqueues and checks the invariants.
fn enqueue(s: &mut State, who: &str, slots: usize, tokens: usize) -> Result<Admit, Rejection> {
    let r = s.enqueue(&tenant(who), slots, tokens);
    s.check();
    r
}

fn queued(s: &mut State, who: &str, slots: usize) -> WaiterId {
    match enqueue(s, who, slots, 10) {
        Ok(Admit::Queued(id)) => id,
        other => panic!("{who}'s request of {slots} should wait: {other:?}"),
    }
}

fn now(s: &mut State, who: &str, slots: usize) {
    assert_eq!(enqueue(s, who, slots, 10), Ok(Admit::Now), "{who} starts");
}

fn release(s: &mut State, who: &str, slots: usize) -> Vec<(WaiterId, Outcome)> {
    s.release(&tenant(who), slots);
    s.check();
    s.take_outbox()
}

fn granted(ids: &[WaiterId], who: &str, slots: usize) -> Vec<(WaiterId, Outcome)> {
    ids.iter()
        .map(|id| {
            (
                *id,
                Outcome::Granted {
                    tenant: tenant(who),
                    slots,
                },
            )
        })
        .collect()
}

fn share(weight: u32, max_running: Option<usize>, max_queued_tokens: Option<usize>) -> Share {
    Share {
        weight: NonZeroU32::new(weight).expect("weight"),
        max_running: max_running.map(|n| NonZeroUsize::new(n).expect("cap")),
        max_queued_tokens,
    }
}

#[test]
fn a_lone_tenant_may_use_every_slot() {
    let mut s = fair(4, 8);
    for _ in 0..4 {
        now(&mut s, "a", 1);
    }
    queued(&mut s, "a", 1);
    assert_eq!((s.running(), s.queued()), (4, 1));
}

/// The noisy neighbour with a reserve of 8 of 64 slots: a tenant sending
/// requests of 16 choices runs three of them (a fourth would leave fewer
/// than 8 free), so another tenant's first request starts at once instead
/// of waiting for one of the three to finish; that tenant's next requests
/// may not take the reserve either while it runs, and once it runs
/// nothing again it may. Arrival order keeps nothing back.
#[test]
fn the_reserve_starts_a_newcomer_at_once() {
    let mut s = State::new(64, 256, Policy::Fair, 8, Shares::default());
    for _ in 0..3 {
        now(&mut s, "noisy", 16);
    }
    let fourth = queued(&mut s, "noisy", 16);
    assert_eq!(s.tenant("noisy"), (48, 16));
    now(&mut s, "probe", 1);
    // 15 free: the probe, running, may take 7 of them, not 8.
    now(&mut s, "probe", 7);
    let held = queued(&mut s, "probe", 8);
    assert_eq!(s.tenant("probe"), (8, 8));
    // Its eight slots back one by one: its request of 8 starts only once
    // it runs nothing, when the reserve is its again.
    for _ in 0..7 {
        assert_eq!(release(&mut s, "probe", 1), vec![]);
    }
    assert_eq!(release(&mut s, "probe", 1), granted(&[held], "probe", 8));
    // A noisy request ends: its fourth starts, 8 being left over.
    assert_eq!(
        release(&mut s, "noisy", 16),
        granted(&[fourth], "noisy", 16)
    );
    assert_eq!(s.tenant("noisy"), (48, 0));

    let mut fifo = State::new(64, 256, Policy::Fifo, 8, Shares::default());
    for _ in 0..4 {
        now(&mut fifo, "noisy", 16);
    }
    queued(&mut fifo, "probe", 1);
}

/// The case: a tenant with 16 requests waiting and another with
/// one; the other's is served at the next free slot, then the first's
/// resume. Arrival order (FIFO) serves all 16 first.
#[test]
fn one_waiting_request_of_another_tenant_goes_before_sixteen() {
    for policy in [Policy::Fair, Policy::Fifo] {
        let mut s = State::new(2, 64, policy, 0, Shares::default());
        now(&mut s, "a", 1);
        now(&mut s, "a", 1);
        let a: Vec<WaiterId> = (0..16).map(|_| queued(&mut s, "a", 1)).collect();
        let b = queued(&mut s, "b", 1);
        let next = release(&mut s, "a", 1);
        match policy {
            Policy::Fair => {
                assert_eq!(next, granted(&[b], "b", 1), "fair: b goes next");
                // b runs one, a one: a's next waits for a slot, then a's
                // requests resume in their order.
                assert_eq!(release(&mut s, "a", 1), granted(&a[..1], "a", 1));
                assert_eq!(release(&mut s, "b", 1), granted(&a[1..2], "a", 1));
            }
            Policy::Fifo => assert_eq!(next, granted(&a[..1], "a", 1), "fifo: a's first"),
        }
    }
}

/// Slots go round-robin among tenants with equal running counts, and by
/// weight: weight 3 against 1 shares four slots 3 to 1.
#[test]
fn slots_are_shared_by_weight_when_tenants_wait() {
    let mut shares = Shares::default();
    shares.set("heavy", share(3, None, None)).expect("set");
    let mut s = State::new(4, 64, Policy::Fair, 0, shares);
    // Something else holds every slot while both queue up.
    for _ in 0..4 {
        now(&mut s, "x", 1);
    }
    for _ in 0..8 {
        queued(&mut s, "heavy", 1);
        queued(&mut s, "light", 1);
    }
    for _ in 0..4 {
        release(&mut s, "x", 1);
    }
    assert_eq!(s.tenant("heavy").0, 3);
    assert_eq!(s.tenant("light").0, 1);
    // Equal weights alternate.
    let mut s = fair(1, 64);
    now(&mut s, "x", 1);
    let a: Vec<_> = (0..2).map(|_| queued(&mut s, "a", 1)).collect();
    let b: Vec<_> = (0..2).map(|_| queued(&mut s, "b", 1)).collect();
    assert_eq!(release(&mut s, "x", 1), granted(&a[..1], "a", 1));
    assert_eq!(release(&mut s, "a", 1), granted(&b[..1], "b", 1));
    assert_eq!(release(&mut s, "b", 1), granted(&a[1..], "a", 1));
    assert_eq!(release(&mut s, "a", 1), granted(&b[1..], "b", 1));
}

#[test]
fn caps_hold_and_refuse_with_typed_errors() {
    let mut shares = Shares::default();
    shares.set("a", share(1, Some(2), Some(25))).expect("set");
    let mut s = State::new(8, 64, Policy::Fair, 0, shares);
    // More choices than the tenant or the server may ever run at once.
    for (who, slots, limit) in [
        ("a", 3, "this API key may run at most 2"),
        ("b", 9, "this server runs at most 8"),
    ] {
        match enqueue(&mut s, who, slots, 10) {
            Err(Rejection::Invalid {
                param: "n",
                message,
            }) => {
                assert!(message.contains(limit), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }
    // The running cap: a's third waits with slots free; b takes them.
    now(&mut s, "a", 1);
    now(&mut s, "a", 1);
    queued(&mut s, "a", 1);
    now(&mut s, "b", 1);
    // The queued-token cap: 10 are queued; 10 more fit, 6 more do not.
    queued(&mut s, "a", 1);
    assert_eq!(
        enqueue(&mut s, "a", 1, 6),
        Err(Rejection::TenantShareExceeded(ShareLimit::QueuedTokens {
            cap: 25
        }))
    );
    // A request that starts at once holds no queued tokens.
    assert_eq!(s.tenant("a"), (2, 2));
    let out = release(&mut s, "a", 1);
    assert_eq!(out.len(), 1, "one of a's starts: {out:?}");
    assert_eq!(s.tenant("a"), (2, 1));
}

/// A request's choices start together; the free slots are kept for the
/// head chosen next, so single requests of a tenant with more running do
/// not pass it forever; a cancelled head gives them back.
#[test]
fn choices_start_together_and_free_slots_are_kept_for_the_next_head() {
    let mut s = fair(4, 64);
    for _ in 0..4 {
        now(&mut s, "a", 1);
    }
    let big = queued(&mut s, "b", 3);
    let small: Vec<_> = (0..2).map(|_| queued(&mut s, "a", 1)).collect();
    assert!(release(&mut s, "a", 1).is_empty(), "kept for b's three");
    assert!(release(&mut s, "a", 1).is_empty());
    assert_eq!(release(&mut s, "a", 1), granted(&[big], "b", 3));
    assert_eq!(s.tenant("b"), (3, 0));
    assert_eq!(s.tenant("a"), (1, 2));
    assert_eq!(release(&mut s, "b", 1), granted(&small[..1], "a", 1));
    // Cancelled while slots were kept for it: they go to the next.
    let mut s = fair(2, 64);
    now(&mut s, "a", 1);
    now(&mut s, "a", 1);
    let big = queued(&mut s, "b", 2);
    let small = queued(&mut s, "a", 1);
    assert!(release(&mut s, "a", 1).is_empty());
    assert!(s.cancel(&tenant("b"), big));
    s.check();
    assert_eq!(s.take_outbox(), granted(&[small], "a", 1));
    assert!(!s.cancel(&tenant("b"), big), "already gone");
    let _ = small;
}

/// A full queue: a tenant under its share gets in by refusing the newest
/// request of the tenant furthest over its own; a tenant at its share is
/// refused with its typed error; alone, the queue is simply full.
#[test]
fn a_full_queue_is_shared_not_taken_by_one_tenant() {
    let mut s = fair(1, 4);
    now(&mut s, "a", 1);
    let a: Vec<_> = (0..4).map(|_| queued(&mut s, "a", 1)).collect();
    assert_eq!(
        enqueue(&mut s, "a", 1, 10),
        Err(Rejection::Saturated { queued: 4 }),
        "alone: full"
    );
    let b = queued(&mut s, "b", 1);
    assert_eq!(
        s.take_outbox(),
        vec![(
            a[3],
            Outcome::Refused(Rejection::TenantShareExceeded(ShareLimit::Queue))
        )]
    );
    assert_eq!(s.tenant("a"), (1, 3));
    assert_eq!(
        enqueue(&mut s, "a", 1, 10),
        Err(Rejection::TenantShareExceeded(ShareLimit::Queue))
    );
    queued(&mut s, "b", 1);
    assert_eq!(s.take_outbox().len(), 1, "a's newest left again");
    assert_eq!((s.tenant("a").1, s.tenant("b").1), (2, 2));
    // Each now holds its share: neither gets more.
    for who in ["a", "b"] {
        assert_eq!(
            enqueue(&mut s, who, 1, 10),
            Err(Rejection::TenantShareExceeded(ShareLimit::Queue))
        );
    }
    // FIFO has no shares: the queue is full for everyone.
    let mut s = State::new(1, 1, Policy::Fifo, 0, Shares::default());
    now(&mut s, "a", 1);
    queued(&mut s, "a", 1);
    assert_eq!(
        enqueue(&mut s, "b", 1, 10),
        Err(Rejection::Saturated { queued: 1 })
    );
    let _ = b;
}

#[test]
fn a_drain_refuses_every_waiting_request_and_every_new_one() {
    let mut s = fair(1, 8);
    now(&mut s, "a", 1);
    let waiting = [queued(&mut s, "a", 1), queued(&mut s, "b", 1)];
    s.close();
    s.check();
    let out = s.take_outbox();
    assert_eq!(out.len(), 2);
    for (id, o) in out {
        assert!(waiting.contains(&id));
        assert_eq!(o, Outcome::Refused(Rejection::ShuttingDown));
    }
    assert_eq!(enqueue(&mut s, "c", 1, 1), Err(Rejection::ShuttingDown));
    // The running request keeps its slot until it ends.
    assert_eq!(s.running(), 1);
    assert!(release(&mut s, "a", 1).is_empty());
    assert_eq!(s.running(), 0);
}

/// One step of the property test.
#[derive(Clone, Debug)]
enum Op {
    Enqueue { tenant: u8, slots: usize },
    Release { pick: usize },
    Cancel { pick: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..4, 1usize..4).prop_map(|(tenant, slots)| Op::Enqueue { tenant, slots }),
        2 => any::<usize>().prop_map(|pick| Op::Release { pick }),
        1 => any::<usize>().prop_map(|pick| Op::Cancel { pick }),
    ]
}

proptest! {
    /// Any sequence of arrivals, ends and departures, either policy, with
    /// a capped and a weighted tenant, with and without a reserve: the
    /// invariants hold after each
    /// step (`State::check`; under fair admission `State::dispatch` also
    /// checks each grant against every other waiting tenant's share),
    /// every outcome is for a waiting request and of its tenant, and every
    /// slot granted is released exactly once.
    #[test]
    fn invariants_hold_under_any_sequence(
        ops in prop::collection::vec(op(), 1..120),
        fifo in any::<bool>(),
        reserve in 0usize..3,
    ) {
        let policy = if fifo { Policy::Fifo } else { Policy::Fair };
        let mut shares = Shares::default();
        shares.set("t0", share(2, None, None)).expect("set");
        shares.set("t1", share(1, Some(3), Some(40))).expect("set");
        let mut s = State::new(5, 6, policy, reserve, shares);
        let mut running: Vec<String> = Vec::new();
        let mut waiting: Vec<(String, WaiterId)> = Vec::new();
        for op in ops {
            match op {
                Op::Enqueue { tenant: i, slots } => {
                    let t = format!("t{i}");
                    match s.enqueue(&tenant(&t), slots, 10) {
                        Ok(Admit::Now) => running.extend(std::iter::repeat_n(t, slots)),
                        Ok(Admit::Queued(id)) => waiting.push((t, id)),
                        Err(_) => {}
                    }
                }
                Op::Release { pick } if !running.is_empty() => {
                    let t = running.swap_remove(pick % running.len());
                    s.release(&tenant(&t), 1);
                }
                Op::Cancel { pick } if !waiting.is_empty() => {
                    let (t, id) = waiting.swap_remove(pick % waiting.len());
                    s.cancel(&tenant(&t), id);
                }
                _ => {}
            }
            s.check();
            for (id, outcome) in s.take_outbox() {
                let Some(at) = waiting.iter().position(|(_, w)| *w == id) else {
                    panic!("an outcome for {id}, which is not waiting");
                };
                let (t, _) = waiting.swap_remove(at);
                if let Outcome::Granted { tenant: g, slots } = outcome {
                    prop_assert_eq!(&g.0, &t);
                    running.extend(std::iter::repeat_n(t, slots));
                }
            }
        }
        prop_assert_eq!(s.running(), running.len());
        // Every request ends: the waiting ones start as slots free, and
        // end too; nothing is left behind.
        while let Some(t) = running.pop() {
            s.release(&tenant(&t), 1);
            s.check();
            for (_, outcome) in s.take_outbox() {
                if let Outcome::Granted { tenant: g, slots } = outcome {
                    running.extend(std::iter::repeat_n(g.0, slots));
                }
            }
        }
        prop_assert_eq!((s.running(), s.queued()), (0, 0));
    }
}

// ---------------------------------------------------------------------------
// The wrapper: permits, waiting, time-outs, cancellation, drain.

fn admission(slots: usize, policy: Policy, queue_timeout: Duration) -> Admission {
    Admission::new(Limits {
        slots,
        max_queued: 64,
        queue_timeout,
        policy,
        reserve: 0,
        shares: Shares::default(),
    })
}

/// Waits until `n` slots are waited for.
async fn until_queued(a: &Admission, n: usize) {
    while a.queued() != n {
        tokio::task::yield_now().await;
    }
}

/// Dropping a permit wakes the other tenant's waiter, not the next of the
/// tenant with sixteen waiting; each waiter reports its tenant when it
/// holds its slot and keeps it until told.
#[tokio::test]
async fn a_released_permit_wakes_the_other_tenants_waiter() {
    let a = admission(1, Policy::Fair, Duration::from_secs(3600));
    let first = a.acquire(&tenant("a"), 1, 5).await.expect("free slot");
    let (got_tx, mut got) = mpsc::channel::<(String, Vec<Permit>)>(32);
    for (i, who) in std::iter::repeat_n("a", 16).chain(["b"]).enumerate() {
        let (a2, got_tx) = (a.clone(), got_tx.clone());
        tokio::spawn(async move {
            let p = a2.acquire(&tenant(who), 1, 5).await.expect("its turn");
            let _ = got_tx.send((who.to_owned(), p)).await;
        });
        until_queued(&a, i + 1).await;
    }
    drop(first);
    let (who, permit) = got.recv().await.expect("a waiter woke");
    assert_eq!(who, "b");
    assert_eq!((a.running(), a.queued()), (1, 16));
    drop(permit);
    let (who, _held) = got.recv().await.expect("the next woke");
    assert_eq!(who, "a");
    assert_eq!((a.running(), a.queued()), (1, 15));
}

#[tokio::test]
async fn a_waiter_past_the_queue_timeout_is_refused_and_leaves() {
    let a = admission(1, Policy::Fair, Duration::from_millis(20));
    let held = a.acquire(&tenant("a"), 1, 5).await.expect("free slot");
    let r = a.acquire(&tenant("b"), 1, 5).await;
    assert!(matches!(r, Err(Rejection::Saturated { .. })), "{r:?}");
    assert_eq!((a.running(), a.queued()), (1, 0));
    drop(held);
    assert_eq!(a.running(), 0);
}

/// A waiter dropped after its grant was sent but before it ran (on this
/// one-thread runtime nothing runs between the two statements) gives the
/// slot back; one dropped while still queued just leaves.
#[tokio::test]
async fn a_cancelled_waiter_leaves_and_a_raced_grant_goes_back() {
    let a = admission(1, Policy::Fair, Duration::from_secs(3600));
    let held = a.acquire(&tenant("a"), 1, 5).await.expect("free slot");
    let (a2, a3) = (a.clone(), a.clone());
    let queued_only = tokio::spawn(async move { a2.acquire(&tenant("b"), 1, 5).await.map(drop) });
    until_queued(&a, 1).await;
    queued_only.abort();
    assert!(queued_only.await.expect_err("aborted").is_cancelled());
    assert_eq!(a.queued(), 0);
    let raced = tokio::spawn(async move { a3.acquire(&tenant("b"), 1, 5).await.map(drop) });
    until_queued(&a, 1).await;
    drop(held);
    assert_eq!(a.running(), 1, "granted to the waiter, which has not run");
    raced.abort();
    assert!(raced.await.expect_err("aborted").is_cancelled());
    assert_eq!((a.running(), a.queued()), (0, 0));
}

#[tokio::test]
async fn a_drain_refuses_the_waiting_at_once() {
    let a = admission(1, Policy::Fair, Duration::from_secs(3600));
    let held = a.acquire(&tenant("a"), 1, 5).await.expect("free slot");
    let a2 = a.clone();
    let waiting = tokio::spawn(async move { a2.acquire(&tenant("b"), 1, 5).await.map(drop) });
    until_queued(&a, 1).await;
    a.close();
    assert_eq!(waiting.await.expect("ran"), Err(Rejection::ShuttingDown));
    assert_eq!(
        a.acquire(&tenant("c"), 1, 5).await.map(drop),
        Err(Rejection::ShuttingDown)
    );
    drop(held);
    assert_eq!(a.running(), 0);
}

#[test]
fn shares_parse_and_refuse_naming_the_field() {
    assert_eq!(
        Share::parse_fields("weight=2:max_running=8:max_queued_tokens=4096"),
        Ok(share(2, Some(8), Some(4096)))
    );
    assert_eq!(Share::parse_fields(""), Ok(Share::default()));
    for (bad, says) in [
        ("weight=0", "weight = 0"),
        ("max_running=0", "max_running = 0"),
        ("max_running=x", "max_running = \"x\""),
        ("speed=3", "unknown field \"speed\""),
        ("weight", "expected NAME=NUMBER"),
    ] {
        let e = Share::parse_fields(bad).expect_err(bad);
        assert!(e.contains(says), "{bad}: {e}");
    }
    let mut shares = Shares::default();
    shares.set("a", share(2, None, None)).expect("set");
    shares
        .set("a", share(2, None, None))
        .expect("the same again");
    assert!(shares.set("a", share(3, None, None)).is_err());
    assert_eq!(shares.of(&tenant("a")).weight.get(), 2);
    assert_eq!(shares.of(&tenant("z")), Share::default());
    shares.set_default(share(1, Some(48), None));
    assert_eq!(shares.of(&tenant("z")).max_running, NonZeroUsize::new(48));
    assert_eq!(shares.of(&tenant("a")).weight.get(), 2, "named: its own");
    assert_eq!("fifo".parse(), Ok(Policy::Fifo));
    assert!("lifo".parse::<Policy>().is_err());
}
