//! Messages the receiver reads (§5.6): a large body the sender leaves
//! where it is, readable by the peer alone, announced by RDV_READ; the
//! receiver RDMA-READs it into memory of its own (which the peer cannot
//! write), delivers it in order with the other messages, and answers
//! RDV_DONE, after which the sender lets the body go. (Or the receiver
//! grants a destination for it and the sender WRITEs it there: §5.7,
//! `dest.rs`.)

use std::collections::VecDeque;

use bytes::BytesMut;

use super::dest::{Announced, Write};
use super::send_ring::Outgoing;
use super::wire::{Header, Kind, HDR_LEN, MAX_READS, READ_MAX};
use super::{sq_wr_id, Action, Buffers, Engine, EngineError, Event, PeerMisbehaved};

/// A message being read (receiver side, §5.6).
#[derive(Debug)]
pub(super) struct ReadJob {
    /// The sender's name for the body (answered in RDV_DONE).
    pub(super) src: u32,
    /// Where the body goes in the message (after the head the RDV_READ
    /// carried).
    pub(super) off: usize,
    /// Body bytes.
    pub(super) len: usize,
    /// The body, at the sender.
    addr: u64,
    rkey: u32,
    pub(super) how: How,
}

/// Where a message is read to.
#[derive(Debug)]
pub(super) enum How {
    /// §5.7: to be written by the sender into destination `dest`, once
    /// granted ([`Engine::grant_dest`]).
    Granted { dest: u32 },
    /// §5.7: destination `dest` granted by RDV_DEST; `written` once the
    /// sender's RDV_WRITTEN arrived.
    Written { dest: u32, written: bool },
    /// One READ into a buffer of its own ([`Buffers::open_dest`]).
    Direct {
        dest: u32,
        /// The READ's send-queue sequence number, once posted (§7).
        seq: Option<u64>,
        /// Its own completion was polled.
        done: bool,
    },
    /// No buffer could be registered for it (the registered-memory cap):
    /// READs of a staging buffer's size into free staging buffers, each
    /// copied out into `buf` when its completion is polled.
    Staged {
        buf: BytesMut,
        /// Body bytes whose READ is posted.
        next: usize,
        pieces: VecDeque<Piece>,
    },
}

/// One READ of a staged message: `len` body bytes from offset `off` into
/// staging buffer `staging`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Piece {
    seq: u64,
    staging: u32,
    off: usize,
    len: usize,
}

impl ReadJob {
    pub(super) fn done(&self) -> bool {
        match &self.how {
            How::Direct { done, .. } => *done,
            How::Granted { .. } => false,
            How::Written { written, .. } => *written,
            How::Staged { next, pieces, .. } => *next == self.len && pieces.is_empty(),
        }
    }
}

/// What is delivered next (§5.6: a message being read holds back those
/// behind it, so the application sees them in the order they were sent).
#[derive(Debug)]
pub(super) enum Inbound {
    Ready(Event),
    /// The next message being read ([`ReadJob`]s, in the same order).
    Reading,
}

/// A body made readable by the peer ([`Buffers::expose_source`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExposedBody {
    /// The id the engine names it by ([`Buffers::release_source`]).
    pub id: u32,
    /// Address of its first byte.
    pub addr: u64,
    /// The rkey the peer reads it with.
    pub rkey: u32,
    /// The rkey is a memory window's that [`Action::BindSource`] binds
    /// (posted before the RDV_READ that announces it).
    pub bind: bool,
}

impl Engine {
    /// Hands `ev` to the application, behind any message being read.
    #[inline]
    pub(super) fn deliver(&mut self, ev: Event) {
        self.inbox.push_back(Inbound::Ready(ev));
    }

    /// §5.6, sender: announces the message at the front of the queue by
    /// RDV_READ when it qualifies (both sides offered reading, a body of
    /// at least `zero_copy_min` bytes, nothing of it sent yet, and the
    /// body could be exposed). `Some(true)`: announced; `Some(false)`: it
    /// waits (for an RDV_DONE or send-queue room); `None`: it goes by
    /// WRITE (§5.2). The caller checked [`data_room`](Self::data_room).
    #[inline]
    pub(super) fn announce_read<B: Buffers + ?Sized>(&mut self, bufs: &mut B) -> Option<bool> {
        let Some(Outgoing::Msg {
            head, body, off: 0, ..
        }) = self.pending.front()
        else {
            return None;
        };
        if !self.cfg.read_rdv
            || self.cfg.zero_copy_min == 0
            || body.len() < self.cfg.zero_copy_min
            || body.len() as u64 > READ_MAX
            || head.len() + body.len() <= self.eager_max
            || head.len() > self.eager_max
        {
            return None;
        }
        // MAX_READS announced and not answered: wait for an RDV_DONE.
        // A bind, the RDV_READ, and one entry kept for a credit message.
        if self.exposed.len() >= MAX_READS as usize || !self.sq_room(4) {
            return Some(false);
        }
        let (head, body) = (head.clone(), body.clone());
        let x = bufs.expose_source(&body)?;
        self.pending.pop_front();
        let total = head.len() + body.len();
        self.pending_bytes -= total;
        if x.bind {
            let (wr_id, signaled) = self.push_record(None, false);
            self.actions.push(Action::BindSource {
                id: x.id,
                wr_id,
                signaled,
            });
        }
        let mut h = Header::new(Kind::RdvRead);
        h.addr = x.addr;
        h.len = x.rkey;
        h.total_len = body.len() as u64;
        h.rdv_index = x.id;
        self.post_send_slot(bufs, h, (&head, &[]), false);
        self.exposed.push(Announced {
            id: x.id,
            len: body.len(),
            write: Write::No,
        });
        self.counters.read_announced += 1;
        self.counters.msgs_sent += 1;
        self.counters.bytes_sent += total as u64;
        Some(true)
    }

    /// §5.6, receiver: an RDV_READ (a SEND of `len` bytes in receive slot
    /// `slot`), checked before anything is read or registered.
    #[inline]
    pub(super) fn on_rdv_read<B: Buffers + ?Sized>(
        &mut self,
        h: &Header,
        slot: u32,
        len: usize,
        bufs: &mut B,
    ) -> Result<(), EngineError> {
        if !self.cfg.read_rdv {
            return Self::proto(PeerMisbehaved::ReadNotOffered {
                kind: h.kind.name(),
            });
        }
        if self.reasm.is_some() {
            return Self::proto(PeerMisbehaved::ReadInsideRendezvous);
        }
        // The sender counts a message until our RDV_DONE, we until its
        // READ completed: a sender within MAX_READS never trips this.
        if self.reads.len() >= MAX_READS as usize {
            return Self::proto(PeerMisbehaved::TooManyReads { max: MAX_READS });
        }
        if self.reads.iter().any(|r| r.src == h.rdv_index) || self.done_due.contains(&h.rdv_index) {
            return Self::proto(PeerMisbehaved::ReadIdInUse { id: h.rdv_index });
        }
        if h.total_len == 0 || h.total_len > READ_MAX || h.addr.checked_add(h.total_len).is_none() {
            return Self::proto(PeerMisbehaved::ReadRange {
                addr: h.addr,
                len: h.total_len,
            });
        }
        // len >= HDR_LEN (the header decoded) and <= the slot (checked).
        let head = len - HDR_LEN;
        let max = self.cfg.max_message;
        if h.total_len > (max - head.min(max)) as u64 {
            return Self::proto(PeerMisbehaved::MessageTooLarge {
                total: h.total_len.saturating_add(head as u64),
                max,
            });
        }
        let body = h.total_len as usize; // <= max_message, a usize
        let head_bytes = bufs.recv_slot(slot)[HDR_LEN..len].to_vec();
        let how = match bufs.open_dest(&head_bytes, body) {
            Ok(dest) => {
                self.read_cache_open = true;
                if self.cfg.grant_dest {
                    // §5.7: written by the sender instead, once granted.
                    How::Granted { dest }
                } else {
                    How::Direct {
                        dest,
                        seq: None,
                        done: false,
                    }
                }
            }
            // No buffer could be registered for it: read through the
            // staging buffers and copy (the copy fallback, §5.6).
            Err(_) => {
                let mut buf = BytesMut::zeroed(head + body);
                buf[..head].copy_from_slice(&head_bytes);
                self.counters.reads_staged += 1;
                How::Staged {
                    buf,
                    next: 0,
                    pieces: VecDeque::new(),
                }
            }
        };
        self.read_used = true;
        self.reads.push_back(ReadJob {
            src: h.rdv_index,
            off: head,
            len: body,
            addr: h.addr,
            rkey: h.len,
            how,
        });
        self.inbox.push_back(Inbound::Reading);
        self.post_reads(bufs)
    }

    /// §5.6: posts the READs not posted yet, in order, while the send
    /// queue has room (one entry kept for a credit message). A READ is
    /// tracked by its own completion, not in the send records: iWARP
    /// (siw) completes SENDs posted after a READ before the READ's
    /// response has arrived, so a later completion does not cover it (§7).
    /// A staged message takes free staging buffers (registered when first
    /// needed; failing that, the connection ends with the cap).
    #[inline]
    pub(super) fn post_reads<B: Buffers + ?Sized>(
        &mut self,
        bufs: &mut B,
    ) -> Result<(), EngineError> {
        // §4.5: an application over its queue limit holds back the READs
        // too: the bytes stay with the sender, which stops after
        // MAX_READS unanswered announcements.
        if self.hold_returns {
            return Ok(());
        }
        for i in 0..self.reads.len() {
            if matches!(self.reads[i].how, How::Granted { .. }) {
                match self.grant_dest(i, bufs) {
                    Some(true) => continue,
                    Some(false) => break,
                    // Not grantable: read (below).
                    None => {}
                }
            }
            match self.reads[i].how {
                How::Granted { .. } | How::Written { .. } => continue,
                How::Direct { seq: Some(_), .. } => continue,
                How::Direct { dest, .. } => {
                    if !self.sq_room(2) {
                        break;
                    }
                    let seq = self.next_read_seq();
                    let r = &mut self.reads[i];
                    r.how = How::Direct {
                        dest,
                        seq: Some(seq),
                        done: false,
                    };
                    self.actions.push(Action::PostRead {
                        dest,
                        off: r.off,
                        len: r.len,
                        remote_addr: r.addr,
                        rkey: r.rkey,
                        wr_id: sq_wr_id(seq),
                    });
                }
                How::Staged { next, .. } => {
                    let mut next = next;
                    while next < self.reads[i].len
                        && !self.free_staging.is_empty()
                        && self.sq_room(2)
                    {
                        if !self.staging_open {
                            bufs.open_staging().map_err(EngineError::Resource)?;
                            self.staging_open = true;
                        }
                        self.staging_used = true;
                        let st = self.free_staging.pop_front().expect("checked");
                        let seq = self.next_read_seq();
                        let r = &mut self.reads[i];
                        let len = self.cfg.staging_bytes.min(r.len - next);
                        // next < len <= READ_MAX, and the announced range
                        // does not wrap (checked): no overflow.
                        self.actions.push(Action::PostReadStaging {
                            staging: st,
                            len,
                            remote_addr: r.addr + next as u64,
                            rkey: r.rkey,
                            wr_id: sq_wr_id(seq),
                        });
                        if let How::Staged {
                            next: n, pieces, ..
                        } = &mut r.how
                        {
                            pieces.push_back(Piece {
                                seq,
                                staging: st,
                                off: next,
                                len,
                            });
                            *n = next + len;
                        }
                        next += len;
                    }
                    if next < self.reads[i].len {
                        // Out of staging buffers or room: later messages
                        // wait (the staging buffers come back in order).
                        break;
                    }
                }
            }
        }
        Ok(())
    }

    /// A send-queue sequence number for a READ, tracked by its own
    /// completion.
    fn next_read_seq(&mut self) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.sq_reads += 1;
        seq
    }

    /// §5.6: a send-queue completion that is a READ's own: whether it was,
    /// and then the messages whose READs are all done are delivered.
    #[inline]
    pub(super) fn on_read_completion<B: Buffers + ?Sized>(
        &mut self,
        seq: u64,
        bufs: &mut B,
    ) -> Result<bool, EngineError> {
        if self.sq_reads == 0 {
            return Ok(false);
        }
        let mut found = false;
        for j in self.reads.iter_mut() {
            match &mut j.how {
                How::Direct {
                    seq: Some(s), done, ..
                } if *s == seq => {
                    *done = true;
                    found = true;
                }
                How::Staged { buf, pieces, .. } => {
                    let Some(at) = pieces.iter().position(|p| p.seq == seq) else {
                        continue;
                    };
                    let p = pieces.remove(at).expect("found");
                    // The READ completed: the staging buffer holds its bytes
                    // and nothing else writes it until it is posted again.
                    let from = j.off + p.off;
                    buf[from..from + p.len].copy_from_slice(&bufs.staging(p.staging)[..p.len]);
                    self.free_staging.push_back(p.staging);
                    found = true;
                }
                How::Direct { .. } | How::Granted { .. } | How::Written { .. } => continue,
            }
            break;
        }
        if !found {
            return Ok(false);
        }
        self.sq_reads -= 1;
        while self.reads.front().is_some_and(ReadJob::done) {
            self.finish_read(bufs)?;
        }
        Ok(true)
    }

    /// §5.6: the oldest READ completed: its message joins the others in
    /// order, and the sender is told it may let the body go.
    pub(super) fn finish_read<B: Buffers + ?Sized>(
        &mut self,
        bufs: &mut B,
    ) -> Result<(), EngineError> {
        let job = self
            .reads
            .pop_front()
            .expect("the caller saw a finished read job");
        let msg = match job.how {
            How::Direct { dest, .. } => {
                self.counters.read_bytes += job.len as u64;
                bufs.take_dest(dest).map_err(EngineError::Resource)?
            }
            // §5.7: take_dest revokes the peer's access first.
            How::Written { dest, .. } => bufs.take_dest(dest).map_err(EngineError::Resource)?,
            How::Granted { .. } => unreachable!("a job not granted is not done"),
            How::Staged { buf, .. } => {
                self.counters.read_bytes += job.len as u64;
                buf.freeze()
            }
        };
        self.counters.msgs_recv += 1;
        self.counters.bytes_recv += msg.len() as u64;
        let at = self
            .inbox
            .iter()
            .position(|i| matches!(i, Inbound::Reading))
            .expect("one placeholder per read job");
        self.inbox[at] = Inbound::Ready(Event::Message(msg));
        self.done_due.push_back(job.src);
        Ok(())
    }

    /// §5.6, sender: the peer read a body we announced.
    #[inline]
    pub(super) fn on_rdv_done<B: Buffers + ?Sized>(
        &mut self,
        h: &Header,
        bufs: &mut B,
    ) -> Result<(), EngineError> {
        if !self.cfg.read_rdv {
            return Self::proto(PeerMisbehaved::ReadNotOffered {
                kind: h.kind.name(),
            });
        }
        let Some(i) = self.exposed.iter().position(|a| a.id == h.rdv_index) else {
            return Self::proto(PeerMisbehaved::ReadDoneUnknown { id: h.rdv_index });
        };
        let a = self.exposed.swap_remove(i);
        // Its READ is over (the peer had its completion), or (§5.7) it has
        // the body we WROTE: the peer reads the body no more.
        self.release_announced(a, bufs);
        Ok(())
    }

    /// §5.6: the RDV_DONEs due, each a control message.
    #[inline]
    pub(super) fn post_read_done<B: Buffers + ?Sized>(&mut self, bufs: &mut B) {
        while !self.done_due.is_empty() && self.data_room() {
            let id = self.done_due.pop_front().expect("checked");
            let mut h = Header::new(Kind::RdvDone);
            h.rdv_index = id;
            self.post_control(bufs, h);
        }
    }

    /// Messages announced by RDV_READ that the peer has not answered yet.
    pub fn reads_announced(&self) -> usize {
        self.exposed.len()
    }

    /// Messages being read from the peer.
    pub fn reads_in_progress(&self) -> usize {
        self.reads.len()
    }
}
