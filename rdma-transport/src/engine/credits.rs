//! Credits (§4.2, §4.3): the send credits the peer returns and the
//! receive credits we owe it, with explicit CREDIT messages when no data
//! carries them; credit grants that grow our receive ring (§4.6), and
//! revokes that take grown credits back (§4.7).

use super::wire::{self, Header, Kind, FLAG_GRANT};
use super::{recv_wr_id, Action, Buffers, Engine, EngineError, PeerMisbehaved};

/// §4.7: where a credit revoke of ours stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Revoke {
    None,
    /// To send: the new limit.
    Due(u32),
    /// Sent; RELEASED with this limit awaited.
    Sent(u32),
}

impl Engine {
    /// Receive back-pressure (§4.5): while set, no receive credits or
    /// rendezvous buffers are returned to the peer, so it stops sending once
    /// it used what it holds. Clearing it lets the next header (or a CREDIT
    /// message from [`progress`](Self::progress)) return everything owed.
    pub fn set_hold_returns(&mut self, hold: bool) {
        self.stir();
        self.hold_returns = hold;
    }

    /// Whether returns are held (§4.5).
    pub fn holding_returns(&self) -> bool {
        self.hold_returns
    }

    /// Messages sent that the peer has not yet returned the credit for
    /// (still in flight, or received but not yet acknowledged): a measure
    /// of how busy the connection is.
    pub fn unreturned_credits(&self) -> u32 {
        // The current limit, not the hello's: after a credit grant (§4.6)
        // the hello's figure would read "all returned" while many are not.
        self.credit_limit.saturating_sub(self.credits)
    }

    /// Current send credits (test/diagnostics).
    pub fn credits(&self) -> u32 {
        self.credits
    }

    /// The credit fields of a received header: a grant raising our limit
    /// (§4.6), a revoke lowering it (§4.7), the answer to our revoke, and
    /// the credits the peer returned (§4.2).
    #[inline]
    pub(super) fn on_credit_flags<B: Buffers + ?Sized>(
        &mut self,
        h: &Header,
        bufs: &mut B,
    ) -> Result<(), EngineError> {
        // §4.6: a credit grant raises our limit first (only a CREDIT
        // message from a peer whose hello offered memory on demand).
        if h.flags & FLAG_GRANT != 0 {
            if h.kind != Kind::Credit || !self.peer_on_demand() {
                return Self::proto(PeerMisbehaved::OnDemandUnexpected {
                    kind: h.kind.name(),
                    why: "with the credit-grant flag, which only an on-demand peer's CREDIT may carry",
                });
            }
            let limit = h.total_len;
            if limit <= u64::from(self.credit_limit) || limit > u64::from(wire::MAX_CREDITS) {
                return Self::proto(PeerMisbehaved::CreditGrantRange {
                    limit,
                    current: self.credit_limit,
                });
            }
            let limit = limit as u32; // <= MAX_CREDITS
            self.credits += limit - self.credit_limit;
            self.credit_limit = limit;
        }
        // §4.7: the peer takes back credits it granted: a lower limit, and a
        // debt our credits pay before we use them.
        if h.flags & wire::FLAG_REVOKE != 0 {
            if h.kind != Kind::Credit || !self.peer_on_demand() {
                return Self::proto(PeerMisbehaved::OnDemandUnexpected {
                    kind: h.kind.name(),
                    why: "with the credit-revoke flag, which only an on-demand peer's CREDIT may carry",
                });
            }
            let limit = h.total_len;
            if self.debt > 0
                || self.released_due.is_some()
                || limit < u64::from(self.cfg.peer.credits)
                || limit >= u64::from(self.credit_limit)
            {
                return Self::proto(PeerMisbehaved::CreditRevokeRange {
                    limit,
                    current: self.credit_limit,
                    initial: self.cfg.peer.credits,
                });
            }
            let limit = limit as u32; // < credit_limit, a u32
            self.debt = self.credit_limit - limit;
            self.credit_limit = limit;
            self.released_due = Some(limit);
        }
        // §4.7: the answer to our revoke: the peer holds no more than the
        // new limit; the slots above it are retired.
        if h.flags & wire::FLAG_RELEASED != 0 {
            match self.revoke {
                Revoke::Sent(limit) if h.kind == Kind::Credit && h.total_len == u64::from(limit) => {
                    self.revoke = Revoke::None;
                    self.recv_active = limit;
                    self.counters.credit_revokes += 1;
                    // Reposts of retired slots not yet handed to the
                    // memory layer are dropped with them (their credits
                    // stay owed: those messages did arrive).
                    self.actions.retain(
                        |a| !matches!(a, Action::PostRecv { slot, .. } if *slot >= limit),
                    );
                    bufs.shrink_recv(limit);
                }
                _ => {
                    return Self::proto(PeerMisbehaved::OnDemandUnexpected {
                        kind: h.kind.name(),
                        why: "with the released flag, which only answers our credit revoke (a CREDIT with its limit)",
                    })
                }
            }
        }
        // §4.2: credits returned by the peer (u64: no overflow whatever it sends).
        // §4.7: while a revoke's debt is unpaid, credits and the debt
        // together stay within the old limit.
        let credits = u64::from(self.credits) + u64::from(h.credit_return);
        let most = u64::from(self.credit_limit) + u64::from(self.debt);
        if credits > most {
            return Self::proto(PeerMisbehaved::TooManyCredits {
                credits,
                granted: most as u32,
            });
        }
        // §4.7: credits beyond the one reserved for CREDIT messages (§4.3)
        // pay the debt first.
        let pay = u64::from(self.debt).min(credits.saturating_sub(1));
        self.debt -= pay as u32;
        let credits = credits - pay;
        self.credits = credits as u32; // <= credit_limit + debt, a u32
        Ok(())
    }

    pub(super) fn fill_returns(&mut self, h: &mut Header) {
        if self.hold_returns {
            return;
        }
        let c = self.owed_total.min(u16::MAX as u32);
        h.credit_return = c as u16;
        self.owed_total -= c;
        self.owed_data = self.owed_data.min(self.owed_total);
        let r = self.rdv_owed.min(u16::MAX as u32);
        h.rdv_return = r as u16;
        self.rdv_owed -= r;
        self.rdv_peer_held += r;
    }

    pub(super) fn peer_on_demand(&self) -> bool {
        self.cfg.peer.flags & wire::HELLO_FLAG_ON_DEMAND != 0
    }

    /// §4.7: credits beyond the initial ones that a revoke could take back.
    pub(super) fn revocable(&self) -> bool {
        self.cfg.revoke_idle
            && self.cfg.peer.flags & wire::HELLO_FLAG_REVOCABLE != 0
            && self.revoke == Revoke::None
            && self.recv_active > self.cfg.initial_recv_slots.clamp(1, self.cfg.recv_slots)
    }

    /// The credit control messages due: a grant of new credits after the
    /// ring grew (§4.6), our revoke, and the answer to the peer's (§4.7).
    #[inline]
    pub(super) fn post_credit_control<B: Buffers + ?Sized>(&mut self, bufs: &mut B) {
        // §4.6: grow the receive ring and grant the peer the new credits
        // (the receives are posted before the grant: actions keep order).
        if self.grant_due
            && !self.hold_returns
            && self.credits >= 1
            && !self.free_send.is_empty()
            && self.sq_room(1)
        {
            self.grant_due = false;
            let new = (self.recv_active * 2).min(self.recv_max);
            match bufs.grow_recv(new) {
                Ok(()) => {
                    for slot in self.recv_active..new {
                        let g = self.recv_gen[slot as usize];
                        self.actions.push(Action::PostRecv {
                            slot,
                            wr_id: recv_wr_id(slot, g),
                        });
                    }
                    self.recv_active = new;
                    self.counters.credit_grants += 1;
                    let mut h = Header::new(Kind::Credit);
                    h.flags = FLAG_GRANT;
                    h.total_len = u64::from(new);
                    self.post_control(bufs, h);
                }
                // The cap: stay at this size.
                Err(_) => self.recv_max = self.recv_active,
            }
        }
        // §4.7: our revoke. Like data it leaves the last credit reserved
        // for CREDIT messages (§4.3): it may return nothing, and a side that
        // spent its last credit on a message returning nothing could meet a
        // peer that did the same (both at 0 credits, each owing the other:
        // found by random_pairs_deliver_everything_before_any_close).
        if let Revoke::Due(limit) = self.revoke {
            if self.credits >= 2 && !self.free_send.is_empty() && self.sq_room(1) {
                self.revoke = Revoke::Sent(limit);
                let mut h = Header::new(Kind::Credit);
                h.flags = wire::FLAG_REVOKE;
                h.total_len = u64::from(limit);
                self.post_control(bufs, h);
            }
        }
        // §4.7: the peer's revoke is paid: say so (not on the credit
        // reserved for CREDIT messages, §4.3, as the revoke above).
        if let (0, Some(limit)) = (self.debt, self.released_due) {
            if self.credits >= 2 && !self.free_send.is_empty() && self.sq_room(1) {
                self.released_due = None;
                let mut h = Header::new(Kind::Credit);
                h.flags = wire::FLAG_RELEASED;
                h.total_len = u64::from(limit);
                self.post_control(bufs, h);
            }
        }
    }

    /// §4.3: an explicit CREDIT message, when returns are due and no data
    /// carried them.
    #[inline]
    pub(super) fn post_credit_message<B: Buffers + ?Sized>(&mut self, bufs: &mut B) {
        // §4.3: explicit credit message when returns are due and no data
        // carried them: half the ring owed for other messages, or the ring
        // but one owed in all. So credit messages cannot ping-pong.
        // §5.3: rendezvous buffers go back in batches while a message is
        // still arriving (half the region at a time), all at once when it
        // is complete.
        // Slots owed for CREDIT messages count only once the peer is down
        // to its reserved credit (ring − 1 owed): counted from half the
        // ring, a CREDIT and a data message owed together made a 4-slot
        // ring answer with a CREDIT, and two sides that read both before
        // answering kept that going, a CREDIT each way per call.
        let half = (self.recv_active / 2).max(1);
        let low = self.recv_active.saturating_sub(1).max(half);
        let rdv_half = (self.cfg.rdv_count / 2).max(1);
        let rdv_due = self.rdv_owed >= rdv_half || (self.rdv_owed > 0 && self.reasm.is_none());
        // §4.7: while our revoke waits for RELEASED, every credit owed goes
        // back at once, so the peer can pay its debt.
        let revoking = matches!(self.revoke, Revoke::Sent(_)) && self.owed_total > 0;
        let owed = self.owed_data >= half || self.owed_total >= low || rdv_due || revoking;
        let due = (owed && !self.hold_returns) || self.force_credit;
        if due && self.credits >= 1 && !self.free_send.is_empty() && self.sq_room(1) {
            let h = Header::new(Kind::Credit);
            self.post_send_slot(bufs, h, (&[], &[]), false);
            self.counters.credit_msgs += 1;
            self.force_credit = false;
        }
    }
}
