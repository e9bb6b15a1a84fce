//! Closing (§6): the CLOSE marker after the last message, the peer's
//! CLOSE, and the confirmation (CLOSE_SEEN) that tells each side every
//! message arrived and it may disconnect.

use super::wire::{Header, Kind, FLAG_CLOSE_SEEN};
use super::{Engine, EngineError, Event, Outgoing, PeerMisbehaved};

impl Engine {
    /// Queues the CLOSE marker (§6); no message may be submitted after it.
    pub fn close(&mut self) {
        self.stir();
        self.pending.push_back(Outgoing::Close);
    }

    /// CLOSE posted and every send-queue work request completed.
    pub fn close_flushed(&self) -> bool {
        self.close_sent
            && self.pending.is_empty()
            && self.records.is_empty()
            // §5.6: the peer read what we announced, we read what it did
            // and told it so; the latter only while the application reads
            // (§6): one that stopped would discard it, and a peer that
            // keeps announcing would hold the connection open.
            && self.exposed.is_empty()
            && (self.app_gone || (self.reads.is_empty() && self.done_due.is_empty()))
    }

    /// CLOSE flushed and the peer confirmed it received it (and therefore
    /// every message before it): safe to disconnect (§6).
    pub fn close_confirmed(&self) -> bool {
        self.close_flushed() && self.peer_saw_close
    }

    /// CLOSE posted.
    pub fn close_sent(&self) -> bool {
        self.close_sent
    }

    /// The peer sent CLOSE.
    pub fn peer_closed(&self) -> bool {
        self.peer_closed
    }

    /// §6: the peer's confirmation of our CLOSE, and what may still come
    /// after the peer's own CLOSE.
    #[inline(always)]
    pub(super) fn on_close_flags(&mut self, h: &Header) -> Result<(), EngineError> {
        if h.flags & FLAG_CLOSE_SEEN != 0 {
            if !self.close_sent {
                return Self::proto(PeerMisbehaved::CloseSeenWithoutClose);
            }
            self.peer_saw_close = true;
        }
        // §6, §5.5: after CLOSE only messages that serve the other
        // direction: returns, our region's grant, revoke and release, the
        // answer to a message we announced for reading (§5.6) or the
        // destination granted for it (§5.7); and the RDV_WRITTEN of a
        // message the peer announced before its CLOSE (§5.7).
        let control = matches!(
            h.kind,
            Kind::Credit
                | Kind::RdvGrant
                | Kind::RdvRevoke
                | Kind::RdvRelease
                | Kind::RdvDone
                | Kind::RdvDest
                | Kind::RdvWritten
        );
        if self.peer_closed && !control {
            return Self::proto(PeerMisbehaved::AfterClose {
                kind: h.kind.name(),
            });
        }
        Ok(())
    }

    /// §6: the peer's CLOSE.
    #[inline]
    pub(super) fn on_peer_close(&mut self) -> Result<(), EngineError> {
        if self.reasm.is_some() {
            return Self::proto(PeerMisbehaved::CloseInsideRendezvous);
        }
        self.peer_closed = true;
        // §6: confirm promptly so the peer may disconnect.
        self.force_credit = true;
        self.deliver(Event::PeerClosed);
        self.owed_data += 1;
        Ok(())
    }
}
