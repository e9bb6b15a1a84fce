//! The send side (§4.1, §4.2, §7): the queue of messages to send, send
//! slots and their work request records, selective signalling, the send
//! ring's growth (§4.6), and keepalives (§4.4).

use bytes::Bytes;

use super::wire::{self, Header, Kind, FLAG_CLOSE_SEEN, FLAG_LAST, HDR_LEN};
use super::{
    sq_seq, sq_wr_id, Action, Buffers, Completion, Engine, EngineError, PeerRdv, WriteSource,
};

#[derive(Debug, Clone, Copy)]
pub(super) enum Held {
    Slot(u32),
    Staging(u32),
}

pub(super) enum Outgoing {
    /// `head` then `body`, one message (a gather: neither is copied until
    /// the bytes go into a send slot or a staging buffer, and `body` not at
    /// all when it is registered as a zero-copy source, §5.1).
    Msg {
        head: Bytes,
        body: Bytes,
        off: usize,
        /// Zero-copy send: `body`'s registration, decided at the first chunk.
        source: Option<u32>,
    },
    Close,
}

/// Copies `dst.len()` bytes of the concatenation `head ++ body`, starting at
/// `start`, into `dst` (the caller keeps `start + dst.len()` within it).
fn copy_gather(head: &[u8], body: &[u8], start: usize, dst: &mut [u8]) {
    let n = dst.len();
    if start < head.len() {
        let h = (head.len() - start).min(n);
        dst[..h].copy_from_slice(&head[start..start + h]);
        dst[h..].copy_from_slice(&body[..n - h]);
    } else {
        let b = start - head.len();
        dst.copy_from_slice(&body[b..b + n]);
    }
}

impl Engine {
    /// Keepalive (§4.4): queue a zero-length RDMA WRITE to the peer, so an
    /// idle connection still has a work request in flight now and then and
    /// a silently dead peer is found by the QP's retry limit. It consumes no
    /// credit and the peer's engine never sees it.
    pub fn keepalive(&mut self) {
        self.stir();
        self.keepalive_due = true;
    }

    /// Queues a message. The caller must already have checked the length
    /// against the peer's `max_message`.
    pub fn submit(&mut self, data: Bytes) {
        self.submit_parts(Bytes::new(), data);
    }

    /// Queues one message made of `head` followed by `body`, without
    /// joining them: the bytes are copied once, into the send slot (eager)
    /// or the staging buffers (rendezvous). The caller must already have
    /// checked the total length against the peer's `max_message`.
    pub fn submit_parts(&mut self, head: Bytes, body: Bytes) {
        self.stir();
        self.pending_bytes += head.len() + body.len();
        self.pending.push_back(Outgoing::Msg {
            head,
            body,
            off: 0,
            source: None,
        });
    }

    /// Messages queued but not yet fully posted.
    pub fn pending_msgs(&self) -> usize {
        self.pending.len()
    }

    /// Payload bytes queued but not yet fully posted.
    pub fn pending_bytes(&self) -> usize {
        self.pending_bytes
    }

    /// Send-queue work requests not yet known complete.
    pub fn outstanding_sq(&self) -> usize {
        self.records.len() + self.sq_reads as usize
    }

    /// Whether progress may wait for a send completion (§8): CLOSE waits
    /// for its flush, fewer than the 2 send slots or the send-queue room a
    /// control message needs are free, or a queued message waits for a
    /// staging buffer, all while a posted work request is outstanding. The
    /// driver arms its send CQ only then, so a send completion does not
    /// wake it otherwise: a queued message that waits for the peer
    /// (credits, rendezvous buffers, its region) is woken by the receive
    /// that brings them, and what a completion frees meanwhile (slots,
    /// staging buffers, zero-copy sources) is collected at the driver's
    /// next full poll.
    pub fn wants_send_completions(&self) -> bool {
        // §5.6: a READ's completion delivers its message.
        self.sq_reads > 0
            || (!self.records.is_empty()
                && (self.close_sent
                    || self.free_send.len() < 2
                    || !self.sq_room(3)
                    || (!self.pending.is_empty() && self.free_staging.is_empty())))
    }

    /// A send-queue completion: frees the send slots, staging buffers and
    /// zero-copy sources of every work request it covers (§7).
    #[inline]
    pub(super) fn on_sq_completion<B: Buffers + ?Sized>(
        &mut self,
        c: Completion,
        bufs: &mut B,
    ) -> Result<(), EngineError> {
        if !c.ok {
            return Err(EngineError::Completion {
                status: c.status,
                recv: false,
            });
        }
        // §7: completions on the SQ are in order, so a completion for
        // sequence s covers every earlier (unsignalled) work request; but a
        // READ (§5.6) only by its own completion.
        let seq = sq_seq(c.wr_id);
        self.on_read_completion(seq, bufs)?;
        while let Some(&(s, held)) = self.records.front() {
            if sq_seq(s) > seq {
                break;
            }
            self.records.pop_front();
            match held {
                Some(Held::Slot(i)) => self.free_send.push_back(i),
                Some(Held::Staging(i)) => self.free_staging.push_back(i),
                None => {}
            }
        }
        while let Some(&(s, id)) = self.sources.front() {
            if s > seq {
                break;
            }
            self.sources.pop_front();
            bufs.release_source(id);
        }
        Ok(())
    }

    pub(super) fn push_record(&mut self, held: Option<Held>, force_signal: bool) -> (u64, bool) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.unsignaled_run += 1;
        // §7: at least every `send_active / 2` work requests is signalled,
        // whatever `signal_every` says. Slots held by unsignalled SENDs come
        // back only with a later signalled completion, so with a longer run
        // a ring that started small (§4.6) could have too few free slots for
        // a control message (RDV_GRANT needs 2, §4.3) and nothing in flight
        // that would ever free one. After CLOSE everything is signalled so
        // the SQ drains completely (§6).
        let every = self.cfg.signal_every.min((self.send_active / 2).max(1));
        let signaled = force_signal || self.close_sent || self.unsignaled_run >= every;
        if signaled {
            self.unsignaled_run = 0;
        }
        self.records.push_back((seq, held));
        (sq_wr_id(seq), signaled)
    }

    pub(super) fn sq_room(&self, n: usize) -> bool {
        self.records.len() + self.sq_reads as usize + n <= self.cfg.sq_depth() as usize
    }

    pub(super) fn post_send_slot<B: Buffers + ?Sized>(
        &mut self,
        bufs: &mut B,
        mut h: Header,
        payload: (&[u8], &[u8]),
        force_signal: bool,
    ) {
        let slot = self
            .free_send
            .pop_front()
            .expect("caller checked free slot");
        self.fill_returns(&mut h);
        if self.peer_closed {
            h.flags |= FLAG_CLOSE_SEEN;
        }
        let b = bufs.send_slot(slot);
        h.encode(&mut b[..HDR_LEN]);
        let plen = payload.0.len() + payload.1.len();
        copy_gather(payload.0, payload.1, 0, &mut b[HDR_LEN..HDR_LEN + plen]);
        let len = HDR_LEN + plen;
        let inline = len <= self.cfg.max_inline;
        if inline {
            self.counters.inline_sends += 1;
        }
        self.credits -= 1;
        let (wr_id, signaled) = self.push_record(Some(Held::Slot(slot)), force_signal);
        self.actions.push(Action::PostSend {
            slot,
            len,
            wr_id,
            signaled,
            inline,
        });
    }

    /// Data (and the on-demand control messages) need 2 credits and 2 free
    /// send slots: one of each stays reserved for credit messages so
    /// returns can never deadlock (§4.3).
    pub(super) fn data_room(&self) -> bool {
        self.credits >= 2 && self.free_send.len() >= 2 && self.sq_room(3)
    }

    /// The message at the front of the queue is partly sent.
    pub(super) fn mid_message(&self) -> bool {
        matches!(self.pending.front(), Some(Outgoing::Msg { off, .. }) if *off > 0)
    }

    /// Posts one on-demand control message (§5.5) from a send slot.
    pub(super) fn post_control<B: Buffers + ?Sized>(&mut self, bufs: &mut B, h: Header) {
        self.post_send_slot(bufs, h, (&[], &[]), false);
        self.counters.credit_msgs += 1;
    }

    /// §4.6: grows the send ring while messages wait for slots (at the
    /// registration cap it stays at its size).
    #[inline]
    pub(super) fn grow_send_ring<B: Buffers + ?Sized>(&mut self, bufs: &mut B) {
        // §4.6: the send ring grows while messages wait for slots.
        if self.free_send.len() < 2
            && self.send_active < self.send_max
            && self.credits >= 2
            && !self.pending.is_empty()
        {
            let new = (self.send_active * 2).min(self.send_max);
            match bufs.grow_send(new) {
                Ok(()) => {
                    self.free_send.extend(self.send_active..new);
                    self.send_active = new;
                }
                Err(_) => self.send_max = self.send_active,
            }
        }
    }

    /// Posts the queued messages, in order, while credits, slots and the
    /// peer's rendezvous buffers allow: eager SENDs (§4.1), rendezvous
    /// chunks (§5.2), CLOSE (§6).
    #[inline]
    pub(super) fn post_pending<B: Buffers + ?Sized>(
        &mut self,
        bufs: &mut B,
    ) -> Result<(), EngineError> {
        loop {
            if !self.data_room() {
                break;
            }
            // §5.6: a large body the peer reads, announced by RDV_READ.
            match self.announce_read(bufs) {
                Some(true) => continue,
                Some(false) => break,
                None => {}
            }
            let mid = self.mid_message();
            let region = match self.peer_rdv {
                PeerRdv::Static | PeerRdv::Granted => true,
                // Revoked: finish the message under way, start none.
                PeerRdv::ReleaseDue => mid,
                PeerRdv::Absent | PeerRdv::Requested => false,
            };
            let rdv_ready = region && self.peer_rdv_avail > 0 && !self.free_staging.is_empty();
            let need_request = self.peer_rdv == PeerRdv::Absent;
            let eager_max = self.eager_max;
            let Some(front) = self.pending.front_mut() else {
                break;
            };
            match front {
                Outgoing::Close => {
                    self.pending.pop_front();
                    let h = Header::new(Kind::Close);
                    self.post_send_slot(bufs, h, (&[], &[]), true);
                    self.close_sent = true;
                }
                Outgoing::Msg {
                    head, body, off, ..
                } if head.len() + body.len() <= eager_max => {
                    let (head, body) = (head.clone(), body.clone());
                    debug_assert_eq!(*off, 0);
                    self.pending.pop_front();
                    let n = head.len() + body.len();
                    self.pending_bytes -= n;
                    let mut h = Header::new(Kind::Eager);
                    h.len = n as u32;
                    self.post_send_slot(bufs, h, (&head, &body), false);
                    self.counters.eager_sends += 1;
                    self.counters.msgs_sent += 1;
                    self.counters.bytes_sent += n as u64;
                }
                Outgoing::Msg { .. } if need_request => {
                    // §5.5: ask for the peer's region first.
                    self.peer_rdv = PeerRdv::Requested;
                    self.post_control(bufs, Header::new(Kind::RdvRequest));
                    break;
                }
                Outgoing::Msg {
                    head,
                    body,
                    off,
                    source,
                } => {
                    // §5.2: one chunk = WRITE into the next peer buffer +
                    // notification (a SEND, or the WRITE's immediate, §5.4).
                    if !rdv_ready {
                        break;
                    }
                    // §5.1: a large enough body is written from where it
                    // is, registered once for the whole message.
                    if *off == 0
                        && self.cfg.zero_copy_min > 0
                        && body.len() >= self.cfg.zero_copy_min
                    {
                        *source = bufs.register_source(body);
                    }
                    let source = *source;
                    let total = head.len() + body.len();
                    let clen = self.chunk.min(total - *off);
                    let start = *off;
                    // Bytes of this chunk that come from a staging buffer:
                    // all of it, or with a source the part of `head` in it.
                    let staged = match source {
                        None => clen,
                        Some(_) => head.len().saturating_sub(start).min(clen),
                    };
                    if staged > 0 && !self.staging_open {
                        bufs.open_staging().map_err(EngineError::Resource)?;
                        self.staging_open = true;
                    }
                    self.staging_used = true;
                    *off += clen;
                    let last = *off == total;
                    let remaining = total - *off;
                    let (head, body) = (head.clone(), body.clone());
                    if last {
                        self.pending.pop_front();
                    }
                    self.pending_bytes -= clen;
                    let st = if staged > 0 {
                        let st = self.free_staging.pop_front().expect("checked");
                        copy_gather(&head, &body, start, &mut bufs.staging(st)[..staged]);
                        Some(st)
                    } else {
                        None
                    };
                    // A chunk all of whose bytes are in `head` reads no source.
                    let write_source = source.filter(|_| staged < clen).map(|id| WriteSource {
                        id,
                        off: start + staged - head.len(),
                        head: staged,
                    });
                    if source.is_some() {
                        self.counters.zero_copy_bytes += (clen - staged) as u64;
                    }
                    let idx = self.peer_rdv_next;
                    self.peer_rdv_next = (idx + 1) % self.cfg.peer.rdv_count;
                    self.peer_rdv_avail -= 1;
                    // idx < peer.rdv_count and the peer's region was checked
                    // not to wrap (Hello::validate in new), so no overflow.
                    let remote_addr =
                        self.peer_rdv_addr + u64::from(idx) * u64::from(self.cfg.peer.rdv_bytes);
                    self.counters.rdv_writes += 1;
                    self.counters.rdv_bytes += clen as u64;
                    if last {
                        self.counters.msgs_sent += 1;
                        self.counters.bytes_sent += total as u64;
                    }
                    // §5.4: with immediates the WRITE's immediate data is
                    // the notification; it consumes a receive buffer (a
                    // credit) at the peer like a SEND, and is signalled so
                    // the staging buffer is released promptly. Otherwise a
                    // CHUNK SEND follows the (unsignalled) WRITE. A chunk
                    // the next one covers ("Covering notifications") has
                    // neither: no credit, no completion of its own.
                    let silent = self.covers_next(last);
                    let imm = (!silent && self.cfg.write_imm).then(|| {
                        let n = if self.cfg.covers {
                            std::mem::take(&mut self.covering) as usize
                        } else {
                            remaining.div_ceil(self.chunk)
                        };
                        wire::chunk_imm(idx, n, last)
                    });
                    let held = st.map(Held::Staging);
                    let (wr_id, signaled) = if silent {
                        self.covering += 1;
                        (self.push_silent_record(held), false)
                    } else {
                        self.push_record(held, imm.is_some())
                    };
                    if let (true, Some(id)) = (last, source) {
                        // The last WRITE reading the source; a completion
                        // covering it (its own, or its notification's)
                        // covers every earlier one (§7).
                        self.sources.push_back((sq_seq(wr_id), id));
                    }
                    self.actions.push(Action::PostWrite {
                        staging: st.unwrap_or(0),
                        len: clen,
                        remote_addr,
                        rkey: self.peer_rdv_rkey,
                        wr_id,
                        signaled,
                        imm,
                        source: write_source,
                    });
                    if silent {
                        continue;
                    }
                    if imm.is_some() {
                        self.credits -= 1;
                        continue;
                    }
                    let mut h = Header::new(Kind::Chunk);
                    h.len = clen as u32;
                    h.rdv_index = idx;
                    h.total_len = total as u64;
                    h.addr = remote_addr;
                    // §5.4: the chunks this one covers, fewer than half the
                    // peer's region (at most 2048): fits.
                    h.covered = std::mem::take(&mut self.covering) as u16;
                    if last {
                        h.flags |= FLAG_LAST;
                    }
                    // Signal the notify so the staging buffer is released promptly.
                    self.post_send_slot(bufs, h, (&[], &[]), true);
                }
            }
        }
        debug_assert_eq!(
            self.covering, 0,
            "a chunk WRITTEN without a notification is covered in the same pass"
        );
        Ok(())
    }

    /// §5.4 "Covering notifications": whether the chunk being posted (its
    /// peer buffer and staging buffer already taken) can go without an
    /// immediate, because the next chunk of the message can certainly be
    /// posted right after it and will notify both. Only where both hellos
    /// offered it and every chunk but the last is the full size the
    /// receiver assumes for a covered chunk, min of the two regions'
    /// buffers. One notification covers at most half the peer's region,
    /// as returns come back by halves (§5.3): the receiver copies one half
    /// out and returns it while the other half lands.
    #[inline]
    fn covers_next(&self, last: bool) -> bool {
        self.cfg.covers
            && !last
            && self.covering + 1 < (self.cfg.peer.rdv_count / 2).max(1)
            && self.chunk == self.covered_chunk_bytes()
            && self.peer_rdv_avail > 0
            && !self.free_staging.is_empty()
            // The next turn's data_room(), with this WRITE on the SQ.
            && self.credits >= 2
            && self.free_send.len() >= 2
            && self.sq_room(4)
    }

    /// Records a chunk WRITE that is never signalled itself (§5.4 covering
    /// notifications): the signalled notification posted right after it in
    /// the same pass covers its completion (§7), so it does not count
    /// towards `signal_every`.
    fn push_silent_record(&mut self, held: Option<Held>) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.records.push_back((seq, held));
        sq_wr_id(seq)
    }

    /// §4.4: the keepalive asked for by [`keepalive`](Self::keepalive).
    #[inline]
    pub(super) fn post_keepalive(&mut self) {
        // §4.4: keepalive, a zero-length WRITE to the start of the peer's
        // region (no data moves, no credit is used, the peer sees nothing);
        // while we hold no region of the peer's (§5.5), a zero-length WRITE
        // to address 0 where the device allows it, else a CREDIT message.
        let peer_region = matches!(
            self.peer_rdv,
            PeerRdv::Static | PeerRdv::Granted | PeerRdv::ReleaseDue
        );
        let write_ok = peer_region || self.cfg.zero_length_write_any_rkey;
        if self.keepalive_due && write_ok && self.sq_room(1) {
            self.keepalive_due = false;
            let (wr_id, signaled) = self.push_record(None, false);
            // Without a region: address and rkey 0, which a zero-length
            // WRITE does not need (C9-88).
            let (remote_addr, rkey) = if peer_region {
                (self.peer_rdv_addr, self.peer_rdv_rkey)
            } else {
                (0, 0)
            };
            self.actions.push(Action::PostWrite {
                staging: 0,
                len: 0,
                remote_addr,
                rkey,
                wr_id,
                signaled,
                imm: None,
                source: None,
            });
        } else if self.keepalive_due && !write_ok {
            self.keepalive_due = false;
            self.force_credit = true;
        }
    }
}
