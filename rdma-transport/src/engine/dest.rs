//! Messages written into a destination the receiver grants (§5.7): the
//! receiver answers an RDV_READ with RDV_DEST, a buffer of its own made
//! writable by this peer alone for this message alone; the sender
//! RDMA-WRITEs the body there and SENDs RDV_WRITTEN; the receiver revokes
//! the peer's access and hands the buffer up, in order, and answers
//! RDV_DONE as for a message it read (§5.6).

use super::read::{How, ReadJob};
use super::wire::{Header, Kind};
use super::{Action, Buffers, Engine, EngineError, PeerMisbehaved, WriteSource};

/// A body we announced by RDV_READ (sender side, §5.6, §5.7).
#[derive(Debug, Clone, Copy)]
pub(super) struct Announced {
    /// The id it is named by.
    pub(super) id: u32,
    /// Body bytes.
    pub(super) len: usize,
    pub(super) write: Write,
}

/// Whether the peer granted a destination for an announced body (§5.7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Write {
    /// None: the peer reads it (or has not answered yet).
    No,
    /// Granted; the WRITE is not posted yet ([`DestDue`]).
    Due,
    /// WRITTEN: the sequence number of the RDV_WRITTEN that follows the
    /// WRITE; a completion covering it means the WRITE is done (§7).
    Posted(u64),
}

/// A destination the peer granted, to WRITE a body into (§5.7).
#[derive(Debug, Clone, Copy)]
pub(super) struct DestDue {
    id: u32,
    addr: u64,
    rkey: u32,
    len: usize,
}

impl Engine {
    /// §5.7, sender: the peer grants a destination for a body we announced.
    #[inline]
    pub(super) fn on_rdv_dest(&mut self, h: &Header) -> Result<(), EngineError> {
        if !self.cfg.write_dest {
            return Self::proto(PeerMisbehaved::DestNotOffered {
                kind: h.kind.name(),
            });
        }
        let id = h.rdv_index;
        let Some(a) = self
            .exposed
            .iter_mut()
            .find(|a| a.id == id && a.write == Write::No)
        else {
            return Self::proto(PeerMisbehaved::DestUnknown { id });
        };
        if h.total_len != a.len as u64 || h.addr.checked_add(h.total_len).is_none() {
            return Self::proto(PeerMisbehaved::DestRange {
                id,
                addr: h.addr,
                len: h.total_len,
                body: a.len as u64,
            });
        }
        a.write = Write::Due;
        let len = a.len;
        self.dest_due.push_back(DestDue {
            id,
            addr: h.addr,
            rkey: h.len,
            len,
        });
        Ok(())
    }

    /// §5.7, sender: WRITEs the bodies whose destinations were granted,
    /// each followed by its RDV_WRITTEN (data: 2 credits, §4.3). The WRITE
    /// reads the body where it is, through the registration that exposed
    /// it (§5.6); it stays registered until the peer's RDV_DONE and a
    /// completion covering the WRITE.
    #[inline]
    pub(super) fn post_dest_writes<B: Buffers + ?Sized>(&mut self, bufs: &mut B) {
        while !self.dest_due.is_empty() && self.data_room() {
            // The next large message's announcement goes ahead of this
            // WRITE on the send queue, so that its grant comes back while
            // the WRITE moves, not after it (a queue pair sends in order;
            // §5.7 3.).
            if self.announce_read(bufs) == Some(true) && !self.data_room() {
                break;
            }
            let d = self.dest_due.pop_front().expect("checked");
            let (wr_id, signaled) = self.push_record(None, false);
            self.actions.push(Action::PostWrite {
                staging: 0,
                len: d.len,
                remote_addr: d.addr,
                rkey: d.rkey,
                wr_id,
                signaled,
                imm: None,
                source: Some(WriteSource {
                    id: d.id,
                    off: 0,
                    head: 0,
                }),
            });
            let mut h = Header::new(Kind::RdvWritten);
            h.rdv_index = d.id;
            self.post_send_slot(bufs, h, (&[], &[]), false);
            let seq = self.next_seq - 1;
            if let Some(a) = self.exposed.iter_mut().find(|a| a.id == d.id) {
                a.write = Write::Posted(seq);
            }
            self.counters.rdv_writes += 1;
            self.counters.rdv_bytes += d.len as u64;
            self.counters.zero_copy_bytes += d.len as u64;
        }
    }

    /// §5.6, §5.7, sender: an RDV_DONE answered body `a` (removed from the
    /// announced ones): its registration goes now, or, if our WRITE into
    /// the peer's destination is not known complete yet, with the
    /// completion that covers it (§7). A body granted a destination and
    /// not WRITTEN yet is not written at all.
    pub(super) fn release_announced<B: Buffers + ?Sized>(&mut self, a: Announced, bufs: &mut B) {
        match a.write {
            Write::No => bufs.release_source(a.id),
            Write::Due => {
                self.dest_due.retain(|d| d.id != a.id);
                bufs.release_source(a.id);
            }
            Write::Posted(seq) => {
                let covered = self.records.front().is_none_or(|&(s, _)| s > seq);
                if covered {
                    bufs.release_source(a.id);
                } else {
                    self.sources.push_back((seq, a.id));
                }
            }
        }
    }

    /// §5.7, receiver: grants message `i` (a [`How::Granted`] job not
    /// granted yet) its destination: the window's bind, then RDV_DEST.
    /// `Some(true)`: granted; `Some(false)`: it waits for credits or
    /// send-queue room; `None`: no destination could be granted, so the
    /// message is read instead (§5.6; the job is now [`How::Direct`]).
    pub(super) fn grant_dest<B: Buffers + ?Sized>(
        &mut self,
        i: usize,
        bufs: &mut B,
    ) -> Option<bool> {
        let ReadJob {
            src, off, len, how, ..
        } = &self.reads[i];
        let How::Granted { dest, .. } = *how else {
            return Some(true);
        };
        let (src, off, len) = (*src, *off, *len);
        // The bind, the RDV_DEST, and the room data keeps (§4.3).
        if !self.data_room() || !self.sq_room(4) {
            return Some(false);
        }
        let x = match bufs.expose_dest(dest, off, len) {
            Ok(x) => x,
            Err(_) => {
                self.reads[i].how = How::Direct {
                    dest,
                    seq: None,
                    done: false,
                };
                return None;
            }
        };
        if x.bind {
            let (wr_id, signaled) = self.push_record(None, false);
            self.actions.push(Action::BindDest {
                dest,
                wr_id,
                signaled,
            });
        }
        let mut h = Header::new(Kind::RdvDest);
        h.rdv_index = src;
        h.addr = x.addr;
        h.len = x.rkey;
        h.total_len = len as u64;
        self.post_send_slot(bufs, h, (&[], &[]), false);
        self.reads[i].how = How::Written {
            dest,
            written: false,
        };
        Some(true)
    }

    /// §5.7, receiver: the peer WROTE a message into the destination we
    /// granted it; the messages whose bodies are all in are delivered, in
    /// order (each buffer out of the peer's reach first, `take_dest`).
    #[inline]
    pub(super) fn on_rdv_written<B: Buffers + ?Sized>(
        &mut self,
        h: &Header,
        bufs: &mut B,
    ) -> Result<(), EngineError> {
        if !self.cfg.grant_dest {
            return Self::proto(PeerMisbehaved::DestNotOffered {
                kind: h.kind.name(),
            });
        }
        let id = h.rdv_index;
        let Some(job) = self
            .reads
            .iter_mut()
            .find(|j| j.src == id && matches!(j.how, How::Written { written: false, .. }))
        else {
            return Self::proto(PeerMisbehaved::WrittenUnknown { id });
        };
        if let How::Written { written, .. } = &mut job.how {
            *written = true;
        }
        self.counters.dest_bytes += job.len as u64;
        while self.reads.front().is_some_and(ReadJob::done) {
            self.finish_read(bufs)?;
        }
        Ok(())
    }
}
