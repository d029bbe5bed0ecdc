//! Who gets the router's dispatch slots: per-tenant fair admission.
//!
//! The router runs at most `max_running` requests' choices at once (one
//! slot per choice: a request with `n: 16` holds 16) and lets at most
//! `max_queued` more wait. Each tenant (an API key's; without keys, the
//! one tenant `default`) waits in its own queue; when slots free, the
//! next request comes from the tenant running the fewest slots per unit
//! of its weight, round-robin among equals ([`Policy::Fair`], the
//! default), so a tenant with many requests waiting cannot keep another
//! tenant's single request behind them. A lone tenant may use every slot
//! but the reserve ([`Limits::reserve`]): slots that only a tenant running
//! nothing may take, so another tenant's first request starts at once
//! rather than after the busy tenant's next completion (by default an
//! eighth of the slots where the keys name several tenants:
//! [`default_reserve`]; 0 makes admission work-conserving).
//! [`Policy::Fifo`] serves in arrival order, as the router did before
//! (kept for comparison and single-tenant meshes; no reserve).
//!
//! Per tenant ([`Share`], configured per API key, and a default for the
//! tenants not named): a weight, a cap on running slots, a cap on queued
//! prompt tokens. A request's choices are
//! admitted together, all or none, so two requests with many choices
//! cannot each hold part of the slots and wait for the rest of each
//! other's; a request with more choices than can ever run at once (more
//! than `max_running`, or than its tenant's cap) is refused at once.
//!
//! [`Admission`] is the one small lock-protected structure: the decisions
//! are made by a plain state (`state`, its invariants there), and a
//! request's slot is a [`Permit`] whose drop gives the slot back and
//! starts whichever request is next. A waiting request whose client
//! leaves, or whose `queue_timeout` passes, leaves the queue (a grant that
//! raced it is given back); a drain ([`Admission::close`]) refuses every
//! waiting request at once. Refusals are [`Rejection`]s; nothing here
//! panics on a client's input, and no figure of any tenant is exported.

mod state;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::num::{NonZeroU32, NonZeroUsize};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::oneshot;

use crate::auth::Tenant;
use crate::error::Rejection;
use state::{Admit, Outcome, State, WaiterId};

/// How waiting requests are ordered when a slot frees.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Policy {
    /// Per-tenant queues; the tenant running the fewest slots per unit of
    /// weight goes next (see the module docs).
    #[default]
    Fair,
    /// One queue in arrival order (the router before per-tenant
    /// admission).
    Fifo,
}

impl Policy {
    /// Its name in flags and the mesh file.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Fair => "fair",
            Self::Fifo => "fifo",
        }
    }
}

impl std::str::FromStr for Policy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fair" => Ok(Self::Fair),
            "fifo" => Ok(Self::Fifo),
            _ => Err(format!(
                "unknown admission policy {s:?}: expected fair or fifo"
            )),
        }
    }
}

/// One tenant's limits. The default is the fair share alone: weight 1,
/// no cap of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Share {
    /// Its weight against the other tenants' when slots are shared out
    /// (and the queue, when it is full).
    pub weight: NonZeroU32,
    /// Slots it may hold at once, whatever is free.
    pub max_running: Option<NonZeroUsize>,
    /// Prompt tokens its waiting requests may hold; past it a request
    /// that must wait is refused (`tenant_share_exceeded`).
    pub max_queued_tokens: Option<usize>,
}

impl Default for Share {
    fn default() -> Self {
        Self {
            weight: NonZeroU32::MIN,
            max_running: None,
            max_queued_tokens: None,
        }
    }
}

impl Share {
    /// The flag form's fields, `weight=W:max_running=N:max_queued_tokens=T`
    /// (any of them, in any order; the others keep their defaults).
    pub fn parse_fields(fields: &str) -> Result<Self, String> {
        let mut share = Self::default();
        for field in fields.split(':').filter(|f| !f.is_empty()) {
            let (name, value) = field
                .split_once('=')
                .ok_or_else(|| format!("{field:?}: expected NAME=NUMBER"))?;
            let number = |what: &str| {
                value
                    .parse::<u64>()
                    .map_err(|_| format!("{name} = {value:?}: {what}"))
            };
            match name {
                "weight" => {
                    share.weight = u32::try_from(number("expected a whole number from 1")?)
                        .ok()
                        .and_then(NonZeroU32::new)
                        .ok_or_else(|| format!("weight = {value}: must be 1 to {}", u32::MAX))?;
                }
                "max_running" => {
                    share.max_running = Some(
                        usize::try_from(number("expected a whole number from 1")?)
                            .ok()
                            .and_then(NonZeroUsize::new)
                            .ok_or_else(|| format!("max_running = {value}: must be at least 1"))?,
                    );
                }
                "max_queued_tokens" => {
                    share.max_queued_tokens = Some(
                        usize::try_from(number("expected a whole number")?)
                            .map_err(|_| format!("max_queued_tokens = {value}: too large"))?,
                    );
                }
                _ => {
                    return Err(format!(
                        "unknown field {name:?}: expected weight, max_running or max_queued_tokens"
                    ))
                }
            }
        }
        Ok(share)
    }
}

/// The tenants' limits; a tenant not named has the default share
/// ([`Share::default`] unless [`Shares::set_default`] says otherwise).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Shares {
    default: Share,
    by_tenant: HashMap<String, Share>,
}

impl Shares {
    /// The limits of every tenant not named: e.g. a `max_running` under
    /// the router's, so that no tenant can hold every slot and another
    /// tenant's request finds one free at once (not work-conserving: the
    /// slots above the cap stay idle while only one tenant is active).
    pub fn set_default(&mut self, share: Share) {
        self.default = share;
    }

    /// Gives `tenant` its limits. Refused: a tenant given two different
    /// ones (several keys may name one tenant; they must agree).
    pub fn set(&mut self, tenant: &str, share: Share) -> Result<(), String> {
        match self.by_tenant.get(tenant) {
            Some(s) if *s != share => Err(format!(
                "tenant {tenant:?} is given two different limits; give every key of a tenant the same"
            )),
            _ => {
                self.by_tenant.insert(tenant.to_owned(), share);
                Ok(())
            }
        }
    }

    /// `tenant`'s limits.
    pub fn of(&self, tenant: &Tenant) -> Share {
        self.by_tenant
            .get(&tenant.0)
            .copied()
            .unwrap_or(self.default)
    }
}

/// What [`Admission`] is built from.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Slots (`max_running`, at least 1).
    pub slots: usize,
    /// Slots that may be waited for at once (`max_queued`).
    pub max_queued: usize,
    /// How long a request may wait before it is refused (`saturated`).
    pub queue_timeout: Duration,
    /// The order of service.
    pub policy: Policy,
    /// Slots only a tenant running nothing may take ([`Policy::Fair`]
    /// only; see the module docs and [`default_reserve`]).
    pub reserve: usize,
    /// Per-tenant limits.
    pub shares: Shares,
}

/// Why a configured reserve cannot be kept ([`check_reserve`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BadReserve {
    /// Arrival order ([`Policy::Fifo`]) keeps no slot back.
    Fifo,
    /// Not under the slots.
    NotUnderSlots,
}

/// Whether `reserve` slots of `slots` can be kept back under `policy`
/// (each configuration layer names its own fields in the refusal).
pub fn check_reserve(policy: Policy, reserve: usize, slots: usize) -> Result<(), BadReserve> {
    if policy == Policy::Fifo {
        return Err(BadReserve::Fifo);
    }
    if reserve >= slots {
        return Err(BadReserve::NotUnderSlots);
    }
    Ok(())
}

/// The reserve when none is configured: an eighth of the slots where the
/// API keys name more than one tenant (so another tenant's first request
/// does not wait for the busy one's next completion), none where there is
/// one tenant (every slot is its own).
pub fn default_reserve(slots: usize, tenants: usize) -> usize {
    if tenants > 1 {
        slots / 8
    } else {
        0
    }
}

/// The admission scheduler. Cheap to clone (one shared state).
#[derive(Clone, Debug)]
pub struct Admission {
    shared: Arc<Mutex<Shared>>,
    queue_timeout: Duration,
}

/// The state and the waiting requests' wake-ups, under one lock.
#[derive(Debug)]
struct Shared {
    state: State,
    waiting: HashMap<WaiterId, oneshot::Sender<Result<(), Rejection>>>,
}

impl Shared {
    /// Delivers what the state decided. A grant whose waiter is gone goes
    /// straight back (which may decide more, hence the loop).
    fn deliver(&mut self) {
        loop {
            let out = self.state.take_outbox();
            if out.is_empty() {
                return;
            }
            for (id, outcome) in out {
                let tx = self.waiting.remove(&id);
                match outcome {
                    Outcome::Granted { tenant, slots } => {
                        if tx.is_none_or(|tx| tx.send(Ok(())).is_err()) {
                            self.state.release(&tenant, slots);
                        }
                    }
                    Outcome::Refused(r) => {
                        if let Some(tx) = tx {
                            let _ = tx.send(Err(r));
                        }
                    }
                }
            }
        }
    }
}

fn lock(m: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    // Nothing panics while holding it; a poisoned lock still holds a
    // consistent state (every operation completes before it unlocks).
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Admission {
    /// A scheduler with these limits.
    pub fn new(limits: Limits) -> Self {
        Self {
            shared: Arc::new(Mutex::new(Shared {
                state: State::new(
                    limits.slots,
                    limits.max_queued,
                    limits.policy,
                    limits.reserve,
                    limits.shares,
                ),
                waiting: HashMap::new(),
            })),
            queue_timeout: limits.queue_timeout,
        }
    }

    /// Slots held now.
    pub fn running(&self) -> usize {
        lock(&self.shared).state.running()
    }

    /// Slots waited for now.
    pub fn queued(&self) -> usize {
        lock(&self.shared).state.queued()
    }

    /// `slots` slots for one request of `tenant` with `tokens` prompt
    /// tokens (all its choices): at once, after waiting its turn, or a
    /// refusal (see the module docs). Cancel-safe: dropped while waiting,
    /// the request leaves the queue and anything granted goes back.
    pub async fn acquire(
        &self,
        tenant: &Tenant,
        slots: usize,
        tokens: usize,
    ) -> Result<Vec<Permit>, Rejection> {
        let slots = slots.max(1);
        let (id, rx) = {
            let mut s = lock(&self.shared);
            let admit = s.state.enqueue(tenant, slots, tokens);
            let id = match admit {
                Ok(Admit::Queued(id)) => id,
                other => {
                    s.deliver();
                    return other.map(|_| self.permits(tenant, slots));
                }
            };
            let (tx, rx) = oneshot::channel();
            s.waiting.insert(id, tx);
            s.deliver();
            (id, rx)
        };
        let mut wait = Waiting {
            shared: &self.shared,
            tenant,
            id,
            slots,
            rx,
            settled: false,
        };
        match tokio::time::timeout(self.queue_timeout, &mut wait.rx).await {
            Ok(Ok(decided)) => {
                wait.settled = true;
                decided.map(|()| self.permits(tenant, slots))
            }
            // Timed out (or, never, no word): `wait` leaves the queue.
            Ok(Err(_)) | Err(_) => Err(Rejection::Saturated {
                queued: self.queued(),
            }),
        }
    }

    /// A drain: the waiting requests are refused now, new ones at once.
    /// Requests holding slots keep them.
    pub fn close(&self) {
        let mut s = lock(&self.shared);
        s.state.close();
        s.deliver();
    }

    fn permits(&self, tenant: &Tenant, slots: usize) -> Vec<Permit> {
        (0..slots)
            .map(|_| Permit {
                shared: Arc::clone(&self.shared),
                tenant: tenant.clone(),
            })
            .collect()
    }
}

/// A request waiting for its slots; dropped undecided (its client left,
/// its time ran out), it leaves the queue, and a grant that raced it
/// goes back.
struct Waiting<'a> {
    shared: &'a Mutex<Shared>,
    tenant: &'a Tenant,
    id: WaiterId,
    slots: usize,
    rx: oneshot::Receiver<Result<(), Rejection>>,
    settled: bool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        let mut s = lock(self.shared);
        s.waiting.remove(&self.id);
        // Grants and refusals are sent under the lock as the request
        // leaves the queue, so if it is not queued any more, its outcome
        // is in the channel.
        if !s.state.cancel(self.tenant, self.id) {
            if let Ok(Ok(())) = self.rx.try_recv() {
                s.state.release(self.tenant, self.slots);
            }
        }
        s.deliver();
    }
}

/// One dispatch slot of one tenant, held for one choice's whole run;
/// dropping it gives the slot back and starts the next request.
#[derive(Debug)]
pub struct Permit {
    shared: Arc<Mutex<Shared>>,
    tenant: Tenant,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut s = lock(&self.shared);
        s.state.release(&self.tenant, 1);
        s.deliver();
    }
}
