//! The receive ring (§4.1, §4.3): receive completions, the header's
//! validation and dispatch by kind, eager messages, and the slot's repost
//! with its credit made returnable.

use super::wire::{Header, Kind, HDR_LEN};
use super::{
    recv_wr_id, Action, Buffers, Completion, Engine, EngineError, Event, Imm, PeerMisbehaved,
    Revoke,
};

impl Engine {
    /// A receive completion: checks that it used a slot and a credit we
    /// posted, hands each part of the header to its concern (credits,
    /// rendezvous returns, close), takes the message or control message
    /// out of the slot, and reposts the slot.
    pub(super) fn on_recv<B: Buffers + ?Sized>(
        &mut self,
        c: Completion,
        bufs: &mut B,
    ) -> Result<(), EngineError> {
        let slot = (c.wr_id & 0xffff_ffff) as u32;
        let gen = ((c.wr_id >> 32) & 0xff_ffff) as u32;
        if slot >= self.recv_active || self.recv_gen[slot as usize] != gen {
            return Self::proto(PeerMisbehaved::StaleReceive { wr_id: c.wr_id });
        }
        let len = c.byte_len as usize;
        let write_imm = match c.imm {
            Imm::None => None,
            Imm::Write(imm) if self.cfg.write_imm => Some(imm),
            Imm::Write(imm) => return Self::proto(PeerMisbehaved::ImmediateNotOffered { imm }),
            Imm::Send(imm) => return Self::proto(PeerMisbehaved::ImmediateOnSend { imm }),
        };
        // An RDMA WRITE with immediate placed its bytes in our rendezvous
        // region, not in the slot: its length is checked in on_imm_chunk.
        if write_imm.is_none() && len > self.cfg.recv_slot_bytes {
            return Self::proto(PeerMisbehaved::ReceiveExceedsSlot {
                len,
                slot: self.cfg.recv_slot_bytes,
            });
        }
        if self.wait_first_recv {
            // §2.3 step 6: P answers A's first message at once (a CREDIT
            // message if nothing else goes out first), which tells A that
            // its messages are being read.
            self.force_credit = true;
            self.wait_first_recv = false;
        }
        self.heard = true;
        if let Some(imm) = write_imm {
            // §5.4: a chunk notified by its WRITE's immediate data. It
            // carries no returns and is data like a CHUNK SEND.
            if self.peer_closed {
                return Self::proto(PeerMisbehaved::AfterClose {
                    kind: "WRITE_WITH_IMM",
                });
            }
            self.on_imm_chunk(imm, len, bufs)?;
            self.owed_data += 1;
            return self.repost(slot, gen);
        }
        let h = Header::decode(&bufs.recv_slot(slot)[..len]).map_err(EngineError::Protocol)?;
        self.on_credit_flags(&h, bufs)?;
        self.on_rdv_returns(&h)?;
        self.on_close_flags(&h)?;
        match h.kind {
            Kind::Eager => {
                // §4.1
                if self.reasm.is_some() {
                    return Self::proto(PeerMisbehaved::EagerInsideRendezvous);
                }
                // len >= HDR_LEN: Header::decode succeeded.
                if h.len as usize != len - HDR_LEN {
                    return Self::proto(PeerMisbehaved::EagerLengthMismatch {
                        header: h.len,
                        carried: len - HDR_LEN,
                    });
                }
                // Copied out of the slot so it can be reposted now, into a
                // buffer of its own (`recv_buf`), not a shared per-thread
                // buffer (as rpc-core's frame arena), where one kept message
                // (a header value, a queued DATA frame a slow handler has
                // not read) would keep a whole shared buffer alive, and a
                // peer sending many small messages could multiply the
                // memory it holds on us by a whole shared buffer per message.
                let msg = super::recv_buf::copy_out(&bufs.recv_slot(slot)[HDR_LEN..len]);
                self.counters.msgs_recv += 1;
                self.counters.bytes_recv += msg.len() as u64;
                self.deliver(Event::Message(msg));
                self.owed_data += 1;
            }
            Kind::Chunk => {
                self.on_chunk(&h, len, bufs)?;
                self.owed_data += 1;
            }
            Kind::Credit => {}
            Kind::RdvRequest => self.on_rdv_request(&h)?,
            Kind::RdvGrant => self.on_rdv_grant(&h)?,
            Kind::RdvRevoke => self.on_rdv_revoke(&h)?,
            Kind::RdvRelease => self.on_rdv_release(&h, bufs)?,
            Kind::RdvRead => {
                self.on_rdv_read(&h, slot, len, bufs)?;
                self.owed_data += 1;
            }
            Kind::RdvDone => self.on_rdv_done(&h, bufs)?,
            Kind::RdvDest => self.on_rdv_dest(&h)?,
            Kind::RdvWritten => self.on_rdv_written(&h, bufs)?,
            Kind::Close => self.on_peer_close()?,
        }
        self.repost(slot, gen)
    }

    /// §4.2, §4.3: checks the receive used a credit we granted, reposts
    /// the slot and makes its credit returnable.
    pub(super) fn repost(&mut self, slot: u32, gen: u32) -> Result<(), EngineError> {
        // §4.2: every SEND consumed a credit we granted. Slots received but
        // not yet returned can exceed the ring only if the peer sent without
        // a credit (it cannot hold credits we have not returned yet).
        if self.owed_total >= self.recv_active {
            return Self::proto(PeerMisbehaved::SendWithoutCredit {
                excess: self.owed_total + 1 - self.recv_active,
                granted: self.recv_active,
            });
        }
        // §4.3: repost immediately; the credit becomes returnable. A slot
        // the peer's RELEASED retired (§4.7; possibly the one that carried
        // it) is not posted again.
        let g = (gen + 1) & 0xff_ffff;
        self.recv_gen[slot as usize] = g;
        if slot < self.recv_active {
            self.actions.push(Action::PostRecv {
                slot,
                wr_id: recv_wr_id(slot, g),
            });
        }
        self.owed_total += 1;
        // §4.6: the peer used half its credits on messages other than
        // CREDIT before we could return them: grow the ring (up to
        // recv_slots) and grant it more. CREDIT messages do not count: a
        // setup's first CREDIT and its answer (§2.3) still owed when the
        // first call arrives would otherwise double every 4-slot ring that
        // carries one call.
        if self.cfg.on_demand
            && !self.hold_returns
            && self.revoke == Revoke::None
            && self.recv_active < self.recv_max
            && self.owed_data * 2 >= self.recv_active
        {
            self.grant_due = true;
        }
        Ok(())
    }
}
