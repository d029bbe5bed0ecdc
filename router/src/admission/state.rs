//! The scheduler's state: plain data, no lock, no channel, no clock, so
//! every decision is unit-tested directly (`super::tests`). The async
//! wrapper ([`super::Admission`]) holds it under one mutex and delivers
//! what each operation decided (the outbox) to the waiting requests.
//!
//! Invariants, checked after every operation in the tests
//! ([`State::check`]):
//! - `running` is the sum of the tenants' running slots and never exceeds
//!   `slots`; `queued` is the sum of their queued slots.
//! - A tenant has an entry only while it runs or waits (the map is bounded
//!   by the tenants active now).
//! - After every operation nothing more can be granted: either no waiting
//!   tenant is eligible, or the head of the one [`State::pick`] chooses
//!   does not fit in the free slots (those slots are then kept for it, so
//!   a request of many choices is not passed over forever by single ones).
//! - Under [`Policy::Fair`], a tenant is granted slots while another
//!   waits only if its running slots per unit of weight are no more than
//!   the other's: no tenant goes over its share while another tenant
//!   below it waits. A lone tenant may use every slot but the reserve.
//! - The reserve: under [`Policy::Fair`] a grant to a tenant that already
//!   runs leaves at least `reserve` slots free; only a tenant running
//!   nothing may take them, so a newcomer's first request starts at once
//!   rather than behind the busy tenant's next completion. With a reserve
//!   of 0 admission is work-conserving.
//! - The queue's bound holds after an operation completes; under
//!   [`Policy::Fair`] a full queue takes a newcomer whose tenant holds less
//!   than its share of it by refusing the newest requests of the tenants
//!   over theirs.
//!
//! Cost: each grant looks at the head of every waiting tenant's queue,
//! O(tenants waiting) per grant, tenants being bounded by the API keys.

use std::collections::{HashMap, VecDeque};

use super::{Policy, Share, Shares};
use crate::auth::Tenant;
use crate::error::{Rejection, ShareLimit};

/// A waiting request's handle.
pub(super) type WaiterId = u64;

/// What the state decided for a waiting request.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Outcome {
    /// It holds `slots` slots of `tenant` now.
    Granted {
        /// Its tenant.
        tenant: Tenant,
        /// Its slots (its choices).
        slots: usize,
    },
    /// It leaves the queue refused.
    Refused(Rejection),
}

/// Where a new request stands after [`State::enqueue`].
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Admit {
    /// It holds its slots already.
    Now,
    /// It waits; its outcome comes through the outbox under this id.
    Queued(WaiterId),
}

/// One waiting request (all its choices: they are admitted together).
#[derive(Debug)]
struct Waiter {
    id: WaiterId,
    slots: usize,
    tokens: usize,
}

/// One tenant's running count and queue.
#[derive(Debug)]
struct TenantQueue {
    share: Share,
    running: usize,
    queue: VecDeque<Waiter>,
    queued_slots: usize,
    queued_tokens: usize,
    /// When it was last granted (the round-robin tie-break: the tenant
    /// served longest ago goes first).
    last_served: u64,
}

impl TenantQueue {
    fn idle(&self) -> bool {
        self.running == 0 && self.queue.is_empty()
    }

    fn weight(&self) -> usize {
        self.share.weight.get() as usize
    }

    /// Of `free` slots, those its next request may take: all of them if
    /// it runs nothing, else all but `reserve`.
    fn usable(&self, free: usize, reserve: usize) -> usize {
        if self.running == 0 {
            free
        } else {
            free.saturating_sub(reserve)
        }
    }

    /// Whether its head may start as far as its own cap goes.
    fn head_within_cap(&self) -> Option<&Waiter> {
        let head = self.queue.front()?;
        match self.share.max_running {
            Some(cap) if self.running + head.slots > cap.get() => None,
            _ => Some(head),
        }
    }
}

/// The admission state.
#[derive(Debug)]
pub(super) struct State {
    /// Dispatch slots (`max_running`).
    slots: usize,
    /// Slots that may be waited for at once (`max_queued`).
    max_queued: usize,
    policy: Policy,
    /// Slots only a tenant running nothing may take (fair only).
    reserve: usize,
    shares: Shares,
    tenants: HashMap<Tenant, TenantQueue>,
    running: usize,
    queued: usize,
    /// Ids in arrival order (FIFO's order as well).
    next_id: WaiterId,
    /// Grants so far (the clock of `last_served`).
    tick: u64,
    closed: bool,
    outbox: Vec<(WaiterId, Outcome)>,
}

impl State {
    /// `reserve` counts under [`Policy::Fair`] only (arrival order keeps
    /// no slot back).
    pub(super) fn new(
        slots: usize,
        max_queued: usize,
        policy: Policy,
        reserve: usize,
        shares: Shares,
    ) -> Self {
        let slots = slots.max(1);
        Self {
            slots,
            max_queued,
            policy,
            reserve: match policy {
                Policy::Fair => reserve.min(slots),
                Policy::Fifo => 0,
            },
            shares,
            tenants: HashMap::new(),
            running: 0,
            queued: 0,
            next_id: 0,
            tick: 0,
            closed: false,
            outbox: Vec::new(),
        }
    }

    /// Slots held now.
    pub(super) fn running(&self) -> usize {
        self.running
    }

    /// Slots waited for now.
    pub(super) fn queued(&self) -> usize {
        self.queued
    }

    /// The decisions made since the last call, for the wrapper to deliver.
    pub(super) fn take_outbox(&mut self) -> Vec<(WaiterId, Outcome)> {
        std::mem::take(&mut self.outbox)
    }

    /// A request of `slots` choices and `tokens` prompt tokens from
    /// `tenant`: started at once, queued, or refused (too many choices
    /// for this server or this tenant ever to run at once; the tenant's
    /// queued-token cap; the queue full; a drain).
    pub(super) fn enqueue(
        &mut self,
        tenant: &Tenant,
        slots: usize,
        tokens: usize,
    ) -> Result<Admit, Rejection> {
        if self.closed {
            return Err(Rejection::ShuttingDown);
        }
        let slots = slots.max(1);
        let share = self.shares.of(tenant);
        if slots > self.slots {
            return Err(too_many(slots, self.slots, "this server runs"));
        }
        if let Some(cap) = share.max_running.filter(|c| slots > c.get()) {
            return Err(too_many(slots, cap.get(), "this API key may run"));
        }
        let id = self.next_id;
        self.next_id += 1;
        let t = self
            .tenants
            .entry(tenant.clone())
            .or_insert_with(|| TenantQueue {
                share,
                running: 0,
                queue: VecDeque::new(),
                queued_slots: 0,
                queued_tokens: 0,
                last_served: 0,
            });
        t.queue.push_back(Waiter { id, slots, tokens });
        t.queued_slots += slots;
        t.queued_tokens = t.queued_tokens.saturating_add(tokens);
        self.queued += slots;
        self.dispatch();
        if let Some(at) = self.outbox.iter().position(|(i, _)| *i == id) {
            self.outbox.remove(at);
            return Ok(Admit::Now);
        }
        match self.bound_queue(tenant, slots) {
            Ok(()) => {
                // Refusing others' requests may have freed the head that
                // kept the free slots.
                self.dispatch();
                Ok(Admit::Queued(id))
            }
            Err(r) => {
                self.cancel(tenant, id);
                Err(r)
            }
        }
    }

    /// `slots` of `tenant`'s running slots come back; the next requests
    /// start.
    pub(super) fn release(&mut self, tenant: &Tenant, slots: usize) {
        if let Some(t) = self.tenants.get_mut(tenant) {
            let slots = slots.min(t.running);
            t.running -= slots;
            self.running -= slots;
            if t.idle() {
                self.tenants.remove(tenant);
            }
        }
        self.dispatch();
    }

    /// Takes waiter `id` of `tenant` out of the queue (its client left or
    /// its time ran out); whether it was still waiting.
    pub(super) fn cancel(&mut self, tenant: &Tenant, id: WaiterId) -> bool {
        let Some(t) = self.tenants.get_mut(tenant) else {
            return false;
        };
        let Some(at) = t.queue.iter().position(|w| w.id == id) else {
            return false;
        };
        let w = t.queue.remove(at).expect("position is in the queue");
        t.queued_slots -= w.slots;
        t.queued_tokens -= w.tokens;
        self.queued -= w.slots;
        if t.idle() {
            self.tenants.remove(tenant);
        }
        // It may have been the head the free slots were kept for.
        self.dispatch();
        true
    }

    /// A drain: every waiting request is refused, and so is every new one.
    pub(super) fn close(&mut self) {
        self.closed = true;
        for t in self.tenants.values_mut() {
            for w in t.queue.drain(..) {
                self.outbox
                    .push((w.id, Outcome::Refused(Rejection::ShuttingDown)));
            }
            t.queued_slots = 0;
            t.queued_tokens = 0;
        }
        self.queued = 0;
        self.tenants.retain(|_, t| !t.idle());
    }

    /// Grants slots while the chosen head fits (see the module docs).
    fn dispatch(&mut self) {
        while self.running < self.slots {
            let Some(tenant) = self.pick() else {
                return;
            };
            let free = self.slots - self.running;
            let t = self.tenants.get_mut(&tenant).expect("picked tenant");
            let usable = t.usable(free, self.reserve);
            let Some(head) = t.queue.front().filter(|w| w.slots <= usable) else {
                // Kept for that head (and the reserve: the tenants that
                // may take it run nothing, so they would have been picked
                // first).
                return;
            };
            let (id, slots, tokens) = (head.id, head.slots, head.tokens);
            #[cfg(test)]
            self.check_fair_grant(&tenant);
            let t = self.tenants.get_mut(&tenant).expect("picked tenant");
            t.queue.pop_front();
            t.queued_slots -= slots;
            t.queued_tokens -= tokens;
            t.running += slots;
            self.tick += 1;
            t.last_served = self.tick;
            self.queued -= slots;
            self.running += slots;
            self.outbox.push((id, Outcome::Granted { tenant, slots }));
        }
    }

    /// The tenant whose head goes next: among the tenants whose head is
    /// within their own cap, the oldest head (FIFO), or the tenant with
    /// the fewest running slots per unit of weight, then the one served
    /// longest ago, then the oldest head (fair).
    fn pick(&self) -> Option<Tenant> {
        let eligible = self
            .tenants
            .iter()
            .filter_map(|(name, t)| t.head_within_cap().map(|h| (name, t, h.id)));
        let best = match self.policy {
            Policy::Fifo => eligible.min_by_key(|(_, _, id)| *id),
            Policy::Fair => eligible.min_by(|(_, a, ia), (_, b, ib)| {
                // a.running / a.weight against b.running / b.weight.
                (a.running * b.weight())
                    .cmp(&(b.running * a.weight()))
                    .then(a.last_served.cmp(&b.last_served))
                    .then(ia.cmp(ib))
            }),
        };
        best.map(|(name, _, _)| name.clone())
    }

    /// Holds the bounds on what waits, the newcomer (`slots` of `tenant`,
    /// already queued) included: the tenant's queued-token cap, then the
    /// queue's bound (see the module docs).
    fn bound_queue(&mut self, tenant: &Tenant, slots: usize) -> Result<(), Rejection> {
        let t = &self.tenants[tenant];
        if let Some(cap) = t.share.max_queued_tokens {
            if t.queued_tokens > cap {
                return Err(Rejection::TenantShareExceeded(ShareLimit::QueuedTokens {
                    cap,
                }));
            }
        }
        if self.queued <= self.max_queued {
            return Ok(());
        }
        let saturated = Rejection::Saturated {
            queued: self.queued - slots,
        };
        if self.policy == Policy::Fifo {
            return Err(saturated);
        }
        // Each waiting tenant's share of the queue, by weight.
        let weights: usize = self
            .tenants
            .values()
            .filter(|t| t.queued_slots > 0)
            .map(TenantQueue::weight)
            .sum();
        let share_of = |t: &TenantQueue| (self.max_queued * t.weight()).div_ceil(weights);
        let own = &self.tenants[tenant];
        if own.queued_slots == self.queued {
            // Alone in the queue: it is simply full.
            return Err(saturated);
        }
        if own.queued_slots > share_of(own) {
            return Err(Rejection::TenantShareExceeded(ShareLimit::Queue));
        }
        // Plan, then apply: the newest requests of the tenants furthest
        // over their shares leave, until the newcomer fits.
        let mut left: Vec<(&Tenant, usize, usize, usize)> = self
            .tenants
            .iter()
            .filter(|(name, t)| *name != tenant && t.queued_slots > share_of(t))
            .map(|(name, t)| (name, t.queued_slots, t.weight(), share_of(t)))
            .collect();
        let mut taken: HashMap<&Tenant, usize> = HashMap::new();
        let mut excess = self.queued - self.max_queued;
        let mut victims = Vec::new();
        while excess > 0 {
            let Some(v) = left
                .iter_mut()
                .filter(|(_, q, _, share)| q > share)
                .max_by(|a, b| (a.1 * b.2).cmp(&(b.1 * a.2)).then(b.0 .0.cmp(&a.0 .0)))
            else {
                return Err(saturated);
            };
            let n = taken.entry(v.0).or_default();
            let queue = &self.tenants[v.0].queue;
            let w = &queue[queue.len() - 1 - *n];
            *n += 1;
            v.1 -= w.slots;
            excess = excess.saturating_sub(w.slots);
            victims.push((v.0.clone(), w.id));
        }
        for (victim, id) in victims {
            let t = self.tenants.get_mut(&victim).expect("a victim waits");
            let at = t.queue.iter().position(|w| w.id == id).expect("planned");
            let w = t.queue.remove(at).expect("planned");
            t.queued_slots -= w.slots;
            t.queued_tokens -= w.tokens;
            self.queued -= w.slots;
            if t.idle() {
                self.tenants.remove(&victim);
            }
            self.outbox.push((
                id,
                Outcome::Refused(Rejection::TenantShareExceeded(ShareLimit::Queue)),
            ));
        }
        Ok(())
    }

    /// `tenant`'s running and queued slots.
    #[cfg(test)]
    pub(super) fn tenant(&self, tenant: &str) -> (usize, usize) {
        self.tenants
            .get(&Tenant(tenant.into()))
            .map_or((0, 0), |t| (t.running, t.queued_slots))
    }

    /// Under fair admission, a grant to `granted` leaves no tenant waiting
    /// within its cap with fewer running slots per unit of weight.
    #[cfg(test)]
    fn check_fair_grant(&self, granted: &Tenant) {
        if self.policy != Policy::Fair {
            return;
        }
        let g = &self.tenants[granted];
        for (name, t) in &self.tenants {
            if t.head_within_cap().is_some() {
                assert!(
                    g.running * t.weight() <= t.running * g.weight(),
                    "{granted:?} (running {}) granted while {name:?} (running {}) waits",
                    g.running,
                    t.running
                );
            }
        }
    }

    /// The invariants of the module docs that hold between operations.
    #[cfg(test)]
    pub(super) fn check(&self) {
        let running: usize = self.tenants.values().map(|t| t.running).sum();
        let queued: usize = self.tenants.values().map(|t| t.queued_slots).sum();
        assert_eq!(running, self.running, "running is the tenants' sum");
        assert_eq!(queued, self.queued, "queued is the tenants' sum");
        assert!(self.running <= self.slots, "over the slots");
        assert!(self.queued <= self.max_queued, "over the queue's bound");
        for (name, t) in &self.tenants {
            assert!(!t.idle(), "{name:?} is idle but kept");
            let tokens: usize = t.queue.iter().map(|w| w.tokens).sum();
            assert_eq!(tokens, t.queued_tokens, "{name:?}'s queued tokens");
            if let Some(cap) = t.share.max_running {
                assert!(t.running <= cap.get(), "{name:?} over its cap");
            }
        }
        if let Some(next) = self.pick() {
            let t = &self.tenants[&next];
            let head = t.queue.front().expect("a head");
            assert!(
                head.slots > t.usable(self.slots - self.running, self.reserve),
                "{next:?}'s head fits but was not granted"
            );
        }
    }
}

/// A request with more choices than can ever run at once.
fn too_many(slots: usize, limit: usize, who: &str) -> Rejection {
    Rejection::Invalid {
        param: "n",
        message: format!(
            "the request asks for {slots} choices (prompts times n), but {who} at most {limit} \
             at once"
        ),
    }
}
