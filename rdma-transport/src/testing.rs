//! A deliberately misbehaving peer for tests (feature `test-util`).
//!
//! [`RawPeer`] sets up a real RC connection to a [`crate::Listener`] exactly
//! as [`crate::connect`] does (§2.3), but then hands the queue pair to the
//! test instead of to the protocol engine: the test writes SEND headers
//! itself and RDMA-WRITEs to any address and rkey it likes. It is how the
//! device tests check that a peer breaking the protocol of
//! `docs/wire-protocol-rdma.md` (sending without credit, naming rendezvous
//! buffers it was never given, writing outside them, forging rkeys) gets its
//! connection closed with an error while nothing else is touched.
//!
//! It is safe code on top of the crate's bounds-checked memory pools: one
//! work request is outstanding at a time and no buffer is written again
//! until the completion of the work request using it was polled (even if
//! the future waiting for it was dropped), like the real driver (§7).

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use rdma_sys::rdma_cm_event_type as ev;

use crate::config::Config;
use crate::conn::{handshake, next_event, resolve, CmFd, Handshake};
use crate::engine::wire::{Header, Hello, Kind, Ticket, HDR_LEN, VERSION};
use crate::engine::{recv_wr_id, sq_wr_id, Action, Buffers, WR_RECV};
use crate::error::Error;
use crate::verbs::cm::{CmId, EventChannel};
use crate::verbs::{Cq, Wc};

/// How long [`RawPeer`] waits for one of its own work completions.
const OP_TIMEOUT: Duration = Duration::from_secs(20);

/// Outcome of one work request posted by a [`RawPeer`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WcStatus {
    /// Raw `ibv_wc_status` (0 = success, 10 = remote access error, 5 = flushed...).
    pub status: u32,
    /// `ibv_wc_status_str` of it.
    pub text: String,
}

impl WcStatus {
    /// `IBV_WC_SUCCESS`.
    pub fn ok(&self) -> bool {
        self.status == 0
    }
}

/// `IBV_WC_REM_ACCESS_ERR`: the peer's NIC refused an RDMA access (bad rkey,
/// or an address outside the region the rkey covers).
pub const WC_REM_ACCESS_ERR: u32 = 10;

/// A connected RC queue pair driven by hand (see the module docs).
pub struct RawPeer {
    hs: Handshake,
    cfg: Config,
    next_seq: u64,
    next_slot: u32,
    received: VecDeque<Vec<u8>>,
    sq_done: VecDeque<Wc>,
    /// The work request posted and not yet seen complete (at most one): its
    /// send slot / staging buffer is not touched again until it is.
    in_flight: Option<u64>,
    disconnected: bool,
    wcs: Vec<Wc>,
}

impl std::fmt::Debug for RawPeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawPeer")
            .field("peer", &self.hs.peer)
            .field("peer_hello", &self.hs.peer_hello)
            .finish()
    }
}

impl RawPeer {
    /// Connects like [`crate::connect`]; `edit_hello` may change the hello
    /// sent to the listener (e.g. advertise fewer credits or a bogus
    /// rendezvous region). Nothing is sent yet: the passive side waits for
    /// the first message (§2.3).
    ///
    /// # Errors
    ///
    /// As [`crate::connect`].
    pub async fn connect(
        addr: SocketAddr,
        cfg: &Config,
        edit_hello: impl FnOnce(&mut Hello),
    ) -> Result<RawPeer, Error> {
        let hs = handshake(addr, None, cfg, None, edit_hello).await?;
        Ok(RawPeer {
            hs,
            cfg: cfg.clone(),
            next_seq: 0,
            next_slot: 0,
            received: VecDeque::new(),
            sq_done: VecDeque::new(),
            in_flight: None,
            disconnected: false,
            wcs: Vec::with_capacity(32),
        })
    }

    /// The listener's hello: its credits and its advertised rendezvous region.
    pub fn peer_hello(&self) -> Hello {
        self.hs.peer_hello
    }

    /// Our address as the listener sees it (`Connection::peer_addr` there).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.hs.id.local_addr()
    }

    /// The hello this peer sent.
    pub fn local_hello(&self) -> Hello {
        self.hs.res.hello
    }

    /// SENDs `bytes` as they are (the caller builds the §3 header) and waits
    /// for the completion. `Err` only for local failures; a refused or
    /// flushed SEND is a non-OK [`WcStatus`].
    ///
    /// # Errors
    ///
    /// A local failure: [`Error::MessageTooLarge`] above a send slot, a
    /// failed post or poll, or [`Error::Timeout`] when no completion came.
    pub async fn send_raw(&mut self, bytes: &[u8]) -> Result<WcStatus, Error> {
        let slot_bytes = self.cfg.recv_slot_bytes;
        if bytes.len() > slot_bytes {
            return Err(Error::MessageTooLarge {
                len: bytes.len(),
                max: slot_bytes,
            });
        }
        self.settle()?;
        let slot = self.next_slot;
        self.next_slot = (slot + 1) % self.cfg.send_slots;
        self.hs.res.mem.send_slot(slot)[..bytes.len()].copy_from_slice(bytes);
        let wr_id = sq_wr_id(self.next_seq);
        self.next_seq += 1;
        self.post_and_wait(
            Action::PostSend {
                slot,
                len: bytes.len(),
                wr_id,
                signaled: true,
                inline: false,
            },
            wr_id,
        )
        .await
    }

    /// SENDs a header-only message of `kind` built by `edit` (§3.1).
    ///
    /// # Errors
    ///
    /// As [`send_raw`](Self::send_raw).
    pub async fn send_header(
        &mut self,
        kind: Kind,
        edit: impl FnOnce(&mut Header),
    ) -> Result<WcStatus, Error> {
        let mut h = Header::new(kind);
        edit(&mut h);
        let mut b = [0u8; HDR_LEN];
        h.encode(&mut b);
        self.send_raw(&b).await
    }

    /// RDMA-WRITEs `data` to (`remote_addr`, `rkey`), whatever they are, and
    /// waits for the completion.
    ///
    /// # Errors
    ///
    /// As [`send_raw`](Self::send_raw); [`Error::MessageTooLarge`] above a
    /// staging buffer, [`Error::ResourceLimit`] when the staging buffers
    /// cannot be registered.
    pub async fn write(
        &mut self,
        data: &[u8],
        remote_addr: u64,
        rkey: u32,
    ) -> Result<WcStatus, Error> {
        self.write_inner(data, remote_addr, rkey, None).await
    }

    /// RDMA-WRITEs `data` with immediate data `imm` (§5.4: a chunk
    /// notification, or a forged one) and waits for the completion. It
    /// consumes one of the listener's posted receive buffers, like a SEND.
    ///
    /// # Errors
    ///
    /// As [`write`](Self::write).
    pub async fn write_with_imm(
        &mut self,
        data: &[u8],
        remote_addr: u64,
        rkey: u32,
        imm: u32,
    ) -> Result<WcStatus, Error> {
        self.write_inner(data, remote_addr, rkey, Some(imm)).await
    }

    async fn write_inner(
        &mut self,
        data: &[u8],
        remote_addr: u64,
        rkey: u32,
        imm: Option<u32>,
    ) -> Result<WcStatus, Error> {
        if data.len() > self.cfg.rendezvous_buffer_bytes {
            return Err(Error::MessageTooLarge {
                len: data.len(),
                max: self.cfg.rendezvous_buffer_bytes,
            });
        }
        self.settle()?;
        self.hs
            .res
            .mem
            .open_staging()
            .map_err(Error::ResourceLimit)?;
        self.hs.res.mem.staging(0)[..data.len()].copy_from_slice(data);
        let wr_id = sq_wr_id(self.next_seq);
        self.next_seq += 1;
        self.post_and_wait(
            Action::PostWrite {
                staging: 0,
                len: data.len(),
                remote_addr,
                rkey,
                wr_id,
                signaled: true,
                imm,
                source: None,
            },
            wr_id,
        )
        .await
    }

    /// Announces `body` for the listener to read (§5.6), as an honest
    /// sender does: exposes it (binding its window first where the PD is
    /// shared) and SENDs RDV_READ naming it `id`. The body stays exposed
    /// while this peer lives. Returns the SEND's status and the exposure.
    ///
    /// # Errors
    ///
    /// As [`send_raw`](Self::send_raw); [`Error::ResourceLimit`] when the
    /// body cannot be exposed.
    pub async fn announce_read(
        &mut self,
        body: &bytes::Bytes,
    ) -> Result<(WcStatus, crate::engine::ExposedBody), Error> {
        self.settle()?;
        let x = self
            .hs
            .res
            .mem
            .expose_source(body)
            .ok_or(Error::ResourceLimit(crate::error::ResourceError::Other(
                "the body could not be exposed".into(),
            )))?;
        if x.bind {
            let wr_id = sq_wr_id(self.next_seq);
            self.next_seq += 1;
            let st = self
                .post_and_wait(
                    Action::BindSource {
                        id: x.id,
                        wr_id,
                        signaled: true,
                    },
                    wr_id,
                )
                .await?;
            if !st.ok() {
                return Ok((st, x));
            }
        }
        let st = self
            .send_header(Kind::RdvRead, |h| {
                h.addr = x.addr;
                h.len = x.rkey;
                h.total_len = body.len() as u64;
                h.rdv_index = x.id;
            })
            .await?;
        Ok((st, x))
    }

    /// RDMA-READs `len` bytes at (`remote_addr`, `rkey`), whatever they
    /// are (§5.6: a body the listener announced, or a forged range), into
    /// a buffer of its own, and waits for the completion: the bytes when it
    /// succeeded.
    ///
    /// # Errors
    ///
    /// As [`send_raw`](Self::send_raw); [`Error::ResourceLimit`] when the
    /// buffer cannot be registered.
    pub async fn read(
        &mut self,
        len: usize,
        remote_addr: u64,
        rkey: u32,
    ) -> Result<(WcStatus, Option<bytes::Bytes>), Error> {
        self.settle()?;
        let mem = &mut self.hs.res.mem;
        let dest = mem.open_dest(&[], len).map_err(Error::ResourceLimit)?;
        let wr_id = sq_wr_id(self.next_seq);
        self.next_seq += 1;
        let st = self
            .post_and_wait(
                Action::PostRead {
                    dest,
                    off: 0,
                    len,
                    remote_addr,
                    rkey,
                    wr_id,
                },
                wr_id,
            )
            .await?;
        // Completed (or flushed): the NIC is done with the buffer.
        let bytes = self
            .hs
            .res
            .mem
            .take_dest(dest)
            .map_err(Error::ResourceLimit)?;
        Ok((st.clone(), st.ok().then_some(bytes)))
    }

    /// The next SEND received from the listener (header included), or `None`
    /// when nothing arrives within `limit` or the connection is gone.
    ///
    /// # Errors
    ///
    /// A failed poll or repost of the receive queue.
    pub async fn recv(&mut self, limit: Duration) -> Result<Option<Vec<u8>>, Error> {
        let end = tokio::time::Instant::now() + limit;
        loop {
            if let Some(m) = self.received.pop_front() {
                return Ok(Some(m));
            }
            if self.disconnected {
                return Ok(None);
            }
            let n = self.poll()?;
            self.check_cm()?;
            if n > 0 {
                continue;
            }
            if tokio::time::Instant::now() >= end {
                return Ok(None);
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Waits up to `limit` for the listener to end the connection (an
    /// rdma_cm DISCONNECTED event, or our receives being flushed because the
    /// QP went to the error state). Returns whether it did.
    ///
    /// # Errors
    ///
    /// A failed poll of the CQ or of the event channel.
    pub async fn wait_disconnected(&mut self, limit: Duration) -> Result<bool, Error> {
        let end = tokio::time::Instant::now() + limit;
        loop {
            self.poll()?;
            self.check_cm()?;
            if self.disconnected {
                return Ok(true);
            }
            if tokio::time::Instant::now() >= end {
                return Ok(false);
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// What an honest active side does after its first message (§2.3 step
    /// 6): waits until the listener's first message has arrived (it stays
    /// queued for [`recv`](Self::recv)), and each time nothing came for a
    /// while (4 ms, then twice as long each time) posts a setup kick, a
    /// zero-length RDMA WRITE to the listener's region. Returns whether the
    /// listener answered within `limit`, and how many kicks were posted.
    ///
    /// # Errors
    ///
    /// As [`recv`](Self::recv), or a failed post of a kick.
    pub async fn wait_for_listener(&mut self, limit: Duration) -> Result<(bool, u32), Error> {
        let end = tokio::time::Instant::now() + limit;
        let mut wait = Duration::from_millis(4);
        let mut kicks = 0;
        loop {
            let until = (tokio::time::Instant::now() + wait).min(end);
            loop {
                self.poll()?;
                self.check_cm()?;
                if !self.received.is_empty() {
                    return Ok((true, kicks));
                }
                if self.disconnected || tokio::time::Instant::now() >= end {
                    return Ok((false, kicks));
                }
                if tokio::time::Instant::now() >= until {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let h = self.hs.peer_hello;
            let st = self.write(&[], h.rdv_addr, h.rdv_rkey).await?;
            if !st.ok() {
                return Ok((false, kicks));
            }
            kicks += 1;
            wait *= 2;
        }
    }

    /// Plays a host that died without a word: our QP is destroyed, so the
    /// listener's packets are dropped unanswered (no ACK, no NAK), but the
    /// cm_id stays, so no disconnect request is sent either — as when a
    /// machine loses power or its link. Nothing can be sent afterwards.
    pub fn go_silent(&mut self) {
        self.hs.res.mem.destroy_qp();
        self.disconnected = true;
    }

    /// Polls the CQs once; receives are copied out and reposted. Returns how
    /// many completions were seen. Send-queue completions are kept in
    /// `sq_done` for `wait_for`.
    fn poll(&mut self) -> Result<usize, Error> {
        self.wcs.clear();
        // Send and receive completions have CQs of their own (§8; the same
        // one on iWARP): both are looked at.
        let n = self.hs.res.send_cq.poll(&mut self.wcs, 32)?
            + self.hs.res.cq.poll(&mut self.wcs, 32)?;
        for i in 0..n {
            let wc = self.wcs[i];
            if wc.wr_id >> 56 == WR_RECV {
                if wc.status != 0 {
                    // Flushed: the QP is in the error state.
                    self.disconnected = true;
                    continue;
                }
                let slot = (wc.wr_id & 0xffff_ffff) as u32;
                let len = (wc.byte_len as usize).min(self.cfg.recv_slot_bytes);
                self.received
                    .push_back(self.hs.res.mem.recv_slot(slot)[..len].to_vec());
                self.hs.res.mem.execute(&[Action::PostRecv {
                    slot,
                    wr_id: recv_wr_id(slot, 0),
                }])?;
            } else {
                self.sq_done.push_back(wc);
            }
        }
        Ok(n)
    }

    fn check_cm(&mut self) -> Result<(), Error> {
        while let Some(e) = self.hs.chan.try_get()? {
            if matches!(
                e.kind,
                ev::RDMA_CM_EVENT_DISCONNECTED | ev::RDMA_CM_EVENT_DEVICE_REMOVAL
            ) {
                // Answer the DREQ: our QP goes to the error state, so work
                // still posted completes (flushed) instead of retrying.
                if !self.disconnected {
                    let _ = self.hs.id.disconnect();
                }
                self.disconnected = true;
            }
        }
        Ok(())
    }

    /// Refuses to touch a buffer while the previous work request on it is
    /// still posted (its future was dropped, or it timed out).
    fn settle(&mut self) -> Result<(), Error> {
        if let Some(w) = self.in_flight {
            self.poll()?;
            if !self.sq_done.iter().any(|c| c.wr_id == w) {
                // The previous wait timed out (or was dropped) and its
                // buffer is still posted: it must not be rewritten.
                return Err(Error::Timeout {
                    stage: "raw peer: previous work request still posted",
                });
            }
            self.sq_done.clear();
            self.in_flight = None;
        }
        Ok(())
    }

    async fn post_and_wait(&mut self, a: Action, wr_id: u64) -> Result<WcStatus, Error> {
        self.hs.res.mem.execute(&[a])?;
        self.in_flight = Some(wr_id);
        let st = self.wait_for(wr_id).await?;
        self.in_flight = None;
        Ok(st)
    }

    async fn wait_for(&mut self, wr_id: u64) -> Result<WcStatus, Error> {
        let end = tokio::time::Instant::now() + OP_TIMEOUT;
        loop {
            if let Some(i) = self.sq_done.iter().position(|w| w.wr_id == wr_id) {
                let wc = self.sq_done.remove(i).expect("index from position");
                self.sq_done.clear();
                return Ok(WcStatus {
                    status: wc.status,
                    text: Cq::status_str(wc.status),
                });
            }
            if tokio::time::Instant::now() >= end {
                return Err(Error::Timeout {
                    stage: "raw peer work completion",
                });
            }
            if self.poll()? == 0 {
                self.check_cm()?;
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    }
}

impl Drop for RawPeer {
    fn drop(&mut self) {
        let _ = self.hs.id.disconnect();
        // The QP goes before the memory it may still access (ConnMemory
        // destroys it first), then the CQ, the cm_id and the channel.
        self.hs.res.mem.destroy_qp();
    }
}

/// A connect request that is never completed: the rdma_cm active side
/// resolves the listener's address and route and calls `rdma_connect` with a
/// valid hello but **without a queue pair**, so when the listener accepts
/// (sends its reply), librdmacm hands this side a CONNECT_RESPONSE that it
/// never answers (no `rdma_establish`, no ready-to-use message): the
/// listener's handshake for it can only end by the listener's own
/// `connect_timeout` — a peer that is slow, broken or malicious on purpose.
///
/// InfiniBand/RoCE only: iWARP's connection manager needs a QP to send a
/// connect request (`start` then fails).
pub struct StalledConnect {
    // afd before chan/id: deregistered before the fd is closed.
    afd: CmFd,
    _id: CmId,
    chan: Arc<EventChannel>,
}

impl std::fmt::Debug for StalledConnect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StalledConnect").finish_non_exhaustive()
    }
}

impl StalledConnect {
    /// Sends the connect request to `addr` (from `local` when given).
    ///
    /// # Errors
    ///
    /// As the setup errors of [`crate::connect`].
    pub async fn start(
        addr: SocketAddr,
        local: Option<IpAddr>,
        cfg: &Config,
    ) -> Result<StalledConnect, Error> {
        StalledConnect::start_with_ticket(addr, local, cfg, None).await
    }

    /// As [`StalledConnect::start`], presenting `ticket` when given (wire
    /// §2.4). Creates no queue pair and registers no memory on this side,
    /// so a test can tell what the listener registered for the request.
    ///
    /// # Errors
    ///
    /// As [`StalledConnect::start`].
    pub async fn start_with_ticket(
        addr: SocketAddr,
        local: Option<IpAddr>,
        cfg: &Config,
        ticket: Option<Ticket>,
    ) -> Result<StalledConnect, Error> {
        let (chan, afd, id) = resolve(addr, local, cfg).await?;
        // A hello the listener accepts (§2.2); nothing ever uses its region.
        let hello = Hello {
            version: VERSION,
            flags: 0,
            credits: 4,
            recv_slot_bytes: 64,
            rdv_count: 1,
            rdv_bytes: 4096,
            rdv_addr: 0x1000_0000,
            rdv_rkey: 0,
            max_message: 1 << 20,
        };
        // Each request names its own (made-up) QP number: the IB CM refuses
        // a second request naming a QP number already in a connection from
        // the same port as stale.
        static NEXT_QPN: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let qpn = 0x00f0_0000
            | ((std::process::id() & 0xff) << 12)
            | (NEXT_QPN.fetch_add(1, std::sync::atomic::Ordering::Relaxed) & 0xfff);
        match &ticket {
            Some(t) => id.connect_qpn(&hello.encode_with_ticket(t), qpn)?,
            None => id.connect_qpn(&hello.encode(), qpn)?,
        }
        Ok(StalledConnect { afd, _id: id, chan })
    }

    /// Waits up to `limit` for the listener's answer and names it:
    /// `"CONNECT_RESPONSE"` (it accepted and now waits for us, forever) or
    /// `"REJECTED"` (with the reason text it sent); `None` if nothing came.
    /// Reading the answer does not complete the handshake.
    ///
    /// # Errors
    ///
    /// A failed read of the event channel.
    pub async fn answer(&self, limit: Duration) -> Result<Option<String>, Error> {
        use rdma_sys::rdma_cm_event_type as ev;
        let e = match tokio::time::timeout(limit, next_event(&self.chan, &self.afd)).await {
            Ok(e) => e?,
            Err(_) => return Ok(None),
        };
        Ok(Some(match e.kind {
            ev::RDMA_CM_EVENT_CONNECT_RESPONSE => "CONNECT_RESPONSE".to_string(),
            ev::RDMA_CM_EVENT_REJECTED => format!(
                "REJECTED: {}",
                String::from_utf8_lossy(&e.private_data).trim_end_matches('\0')
            ),
            k => format!("event {k} (status {})", e.status),
        }))
    }
}

/// Sends a side request (wire protocol §10.2: the connect request that
/// opens a connection's side queue pair) to the listener at `addr` with
/// `token`, from a queue pair of its own: `Ok` if the listener accepted it
/// (it is then disconnected at once), else the connect error (an unknown
/// token: [`Error::Rejected`] with the reason `unknown side token`).
///
/// # Errors
///
/// As [`crate::connect`].
pub async fn side_request(
    addr: SocketAddr,
    cfg: &Config,
    token: crate::engine::wire::SideToken,
) -> Result<(), Error> {
    let hello = Hello {
        version: VERSION,
        flags: crate::engine::wire::HELLO_FLAG_REMOTE,
        credits: 4,
        recv_slot_bytes: 8192,
        rdv_count: 1,
        rdv_bytes: 4096,
        rdv_addr: 0,
        rdv_rkey: 0,
        max_message: 1 << 20,
    };
    crate::conn::raw_side_request(addr, cfg, hello, token).await
}
