//! Memory on demand's idle release (§4.7, §5.5): once per idle interval,
//! what went unused for a whole interval is given back (grown credits, our
//! rendezvous region, the staging buffers, the grown send ring, the
//! buffers kept for messages read from the peer).

use super::{Buffers, Engine, LocalRdv, Revoke};

impl Engine {
    /// Whether [`on_idle_tick`](Self::on_idle_tick) could give anything
    /// back (a granted region, open staging buffers, a grown send ring): an
    /// idle connection that holds only its initial rings needs no timer.
    pub fn has_releasable(&self) -> bool {
        self.local_rdv == LocalRdv::Granted
            || self.staging_open
            || self.send_active > self.cfg.initial_send()
            || self.revocable()
            || self.read_cache_open
    }

    /// Memory on demand (§5.5), called by the driver once per idle
    /// interval, then [`progress`](Self::progress): what was not used
    /// during a whole interval is given back. Our rendezvous region is
    /// revoked (it is deregistered when the peer's RDV_RELEASE arrives),
    /// the staging buffers are released, the send ring shrinks to its
    /// initial size.
    pub fn on_idle_tick<B: Buffers + ?Sized>(&mut self, bufs: &mut B) {
        self.stir();
        // §4.7: a ring that grew and received nothing for a whole interval
        // goes back to its initial size (a REVOKE, then the peer's RELEASED).
        if self.revocable()
            && self.counters.msgs_recv == self.recv_seen
            && !self.grant_due
            && !self.hold_returns
            && !self.peer_closed
        {
            self.revoke = Revoke::Due(self.cfg.initial_recv_slots.clamp(1, self.cfg.recv_slots));
        }
        self.recv_seen = self.counters.msgs_recv;
        if self.local_rdv == LocalRdv::Granted
            && !self.rdv_used
            && self.reasm.is_none()
            && self.rdv_owed == 0
            && self.rdv_peer_held == self.cfg.rdv_count
            && !self.peer_closed
        {
            self.local_rdv = LocalRdv::Revoking { sent: false };
        }
        self.rdv_used = false;
        if self.staging_open
            && !self.staging_used
            && self.free_staging.len() == self.cfg.staging_count as usize
            && !self.mid_message()
        {
            // No posted WRITE uses a staging buffer (all are free).
            bufs.close_staging();
            self.staging_open = false;
        }
        self.staging_used = false;
        // §5.6: the buffers kept for messages read from the peer, when no
        // READ started during the interval and none is in progress.
        if self.read_cache_open && !self.read_used && self.reads.is_empty() {
            bufs.close_read_cache();
            self.read_cache_open = false;
        }
        self.read_used = false;
        let initial = self.cfg.initial_send();
        if self.send_active > initial
            && self.free_send.len() == self.send_active as usize
            && self.pending.is_empty()
        {
            // Every slot is free: no posted SEND covers any of them.
            self.free_send.retain(|&i| i < initial);
            bufs.shrink_send(initial);
            self.send_active = initial;
        }
    }
}
