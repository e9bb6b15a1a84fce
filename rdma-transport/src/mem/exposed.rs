//! The application's memory registered for one-sided access (wire protocol
//! §10): [`UserMr`], a registration of the exact bytes of a `Bytes` or
//! `BytesMut` in a connection's exposure PD (an exposure, or the local
//! buffer of a READ or WRITE, possibly one a [`LocalCache`](super::LocalCache) keeps), and
//! [`SideQp`], the side queue pair that owns every buffer posted on it
//! until its completion is polled or the queue pair is destroyed.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use rdma_sys::*;

use super::local_cache::Home;
use super::REGISTERED_BYTES;
use crate::error::{Error, RemoteError, ResourceError};
use crate::remote::{Exposable, RemoteAccess};
// Named imports shadow rdma-sys' `extern` declarations: these call the
// libraries loaded at run time (see `verbs::dl`).
use crate::verbs::dl::{ibv_dereg_mr, ibv_reg_mr};
use crate::verbs::{verb_err, OneSidedDesc, Pd, Qp};

/// What a [`UserMr`] lets the NIC do with the buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MrUse {
    /// Read by our own RDMA WRITE (its source): no access flag at all.
    WriteSource,
    /// Written by our own RDMA READ (its destination): local write.
    ReadDestination,
    /// A message's body the peer reads through a type-2 memory window
    /// bound to one queue pair (wire protocol §5.6, in a shared PD): the
    /// MR itself grants no remote access.
    WindowSource,
    /// Reached by the peer through the rkey with this access (an exposure).
    Exposed(RemoteAccess),
}

impl MrUse {
    fn flags(self) -> u32 {
        use ibv_access_flags as f;
        match self {
            MrUse::WriteSource => 0,
            MrUse::ReadDestination => f::IBV_ACCESS_LOCAL_WRITE.0,
            MrUse::WindowSource => f::IBV_ACCESS_MW_BIND.0,
            MrUse::Exposed(RemoteAccess::Read) => f::IBV_ACCESS_REMOTE_READ.0,
            // Remote write needs local write (ibv_reg_mr(3)).
            MrUse::Exposed(RemoteAccess::Write) => {
                f::IBV_ACCESS_REMOTE_WRITE.0 | f::IBV_ACCESS_LOCAL_WRITE.0
            }
            MrUse::Exposed(RemoteAccess::ReadWrite) => {
                f::IBV_ACCESS_REMOTE_READ.0
                    | f::IBV_ACCESS_REMOTE_WRITE.0
                    | f::IBV_ACCESS_LOCAL_WRITE.0
            }
        }
    }

    /// Whether the NIC may write the buffer.
    fn writes(self) -> bool {
        self.flags() & ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 != 0
    }
}

/// The exact bytes of an application buffer registered in a PD.
///
/// An exposure's buffer ([`MrUse::Exposed`]) is reached only by the NIC
/// while it lives (the CPU never reads or writes it, no reference over it
/// is formed: the peer may write it at any time); [`UserMr::into_inner`]
/// deregisters it before it gives the buffer back, so the application
/// never sees memory the NIC may still write.
///
/// A local buffer (a READ's destination or a WRITE's source) has no key
/// the peer could use, and only our own work requests touch it: while it
/// is posted, [`SideQp`] owns it; a `UserMr` held by value is in no work
/// request, so its bytes may be read ([`UserMr::local_bytes`]) and
/// written ([`UserMr::local_bytes_mut`]). One that came from a
/// [`LocalCache`](super::LocalCache) goes back to it when dropped, still registered.
pub(crate) struct UserMr {
    mr: *mut ibv_mr,
    /// `Some` until given back.
    buf: Option<Exposable>,
    addr: u64,
    len: usize,
    how: MrUse,
    pd: Arc<Pd>,
    /// The cache a local buffer goes back to when dropped.
    home: Option<Home>,
}

// SAFETY: the buffer is uniquely owned (a `BytesMut`, or a `Bytes` the NIC
// only reads); the MR pointer is only passed to thread-safe libibverbs
// calls.
unsafe impl Send for UserMr {}

impl UserMr {
    /// Registers `buf`'s bytes in `pd` for `how`, counting them against
    /// `global_limit` (`Config::global_max_registered_bytes`).
    pub(crate) fn new(
        pd: &Arc<Pd>,
        buf: Exposable,
        how: MrUse,
        global_limit: usize,
    ) -> Result<UserMr, Error> {
        let mut buf = buf;
        let (ptr, len) = match &mut buf {
            // The NIC must never write memory other `Bytes` may share.
            Exposable::Shared(_) if how.writes() => {
                return Err(Error::Remote(RemoteError::SharedNotWritable))
            }
            Exposable::Shared(b) => (b.as_ptr() as *mut u8, b.len()),
            Exposable::Owned(b) => (b.as_mut_ptr(), b.len()),
        };
        if len == 0 {
            return Err(Error::Remote(RemoteError::Empty));
        }
        let prev = REGISTERED_BYTES.fetch_add(len, Ordering::SeqCst);
        if prev + len > global_limit {
            REGISTERED_BYTES.fetch_sub(len, Ordering::SeqCst);
            return Err(Error::ResourceLimit(ResourceError::RegisteredBytes {
                requested: len,
                cap: global_limit,
                in_use: prev,
            }));
        }
        // A `Bytes`/`BytesMut` points to a heap or static buffer that moving
        // the handle does not move, so owning `buf` keeps it allocated and put.
        // SAFETY: [ptr, ptr+len) is the live, initialised memory of `buf`, which
        // this UserMr owns until it is deregistered; pd is live. A `Bytes` is
        // registered without write access (above).
        let mr = unsafe { ibv_reg_mr(pd.ptr, ptr.cast(), len, how.flags() as i32) };
        if mr.is_null() {
            REGISTERED_BYTES.fetch_sub(len, Ordering::SeqCst);
            return Err(Error::ResourceLimit(ResourceError::from_error(verb_err(
                "ibv_reg_mr",
            ))));
        }
        crate::stats::GLOBAL
            .memory_registrations
            .fetch_add(1, Ordering::Relaxed);
        Ok(UserMr {
            mr,
            buf: Some(buf),
            addr: ptr as u64,
            len,
            how,
            pd: pd.clone(),
            home: None,
        })
    }

    /// Makes a local buffer go back to its cache when dropped (`None`: be
    /// deregistered when dropped).
    pub(crate) fn set_home(&mut self, home: Option<Home>) {
        debug_assert!(home.is_none() || !matches!(self.how, MrUse::Exposed(_)));
        self.home = home;
    }

    /// Whether it goes back to a cache when dropped.
    pub(crate) fn is_cached(&self) -> bool {
        self.home.is_some()
    }

    /// The bytes of a local buffer (a READ's destination, a WRITE's
    /// source); empty for an exposure, whose bytes the peer may be writing.
    /// Held by value, a local buffer is in no work request (see the type's
    /// doc), so nothing but the CPU touches it now.
    pub(crate) fn local_bytes(&self) -> &[u8] {
        match (&self.buf, self.how) {
            (_, MrUse::Exposed(_)) | (None, _) => &[],
            (Some(Exposable::Shared(b)), _) => b,
            (Some(Exposable::Owned(b)), _) => b,
        }
    }

    /// The bytes of a local buffer this side owns alone (`None` for an
    /// exposure or a shared `Bytes`), to fill before a WRITE.
    pub(crate) fn local_bytes_mut(&mut self) -> Option<&mut [u8]> {
        match (&mut self.buf, self.how) {
            (_, MrUse::Exposed(_)) => None,
            (Some(Exposable::Owned(b)), _) => Some(&mut b[..]),
            _ => None,
        }
    }

    pub(crate) fn addr(&self) -> u64 {
        self.addr
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether this is a READ's destination.
    pub(crate) fn is_read_destination(&self) -> bool {
        self.how == MrUse::ReadDestination
    }

    pub(crate) fn rkey(&self) -> u32 {
        // SAFETY: mr is live while self exists (deregistered only by
        // `deregister`, after which `buf` is None and no accessor runs);
        // plain field read.
        unsafe { (*self.mr).rkey }
    }

    pub(crate) fn lkey(&self) -> u32 {
        // SAFETY: as for rkey.
        unsafe { (*self.mr).lkey }
    }

    /// The MR, to bind a memory window over ([`MrUse::WindowSource`]).
    pub(crate) fn mr(&self) -> *mut ibv_mr {
        self.mr
    }

    /// Deregisters the MR (once). After `ibv_dereg_mr` returns 0 the NIC
    /// can no longer touch the buffer. `false` if it failed: then the
    /// buffer must never be freed nor handed out (the device may still map
    /// it).
    fn deregister(&mut self) -> bool {
        if self.mr.is_null() {
            return true;
        }
        // SAFETY: mr was registered in `new` and is deregistered only here (then set to null).
        // Every work request that used it as a local buffer completed or its QP was destroyed
        // ([`SideQp`] keeps it until then).
        let r = unsafe { ibv_dereg_mr(self.mr) };
        if r != 0 {
            tracing::warn!(
                "ibv_dereg_mr of an application buffer of {} bytes failed: {}; leaking it",
                self.len,
                crate::error::Errno(r)
            );
            return false;
        }
        self.mr = std::ptr::null_mut();
        REGISTERED_BYTES.fetch_sub(self.len, Ordering::SeqCst);
        true
    }

    /// Deregisters the buffer and gives it back; `None` when
    /// deregistering failed (the buffer is leaked, never handed out).
    pub(crate) fn into_inner(mut self) -> Option<Exposable> {
        if self.deregister() {
            self.buf.take()
        } else {
            std::mem::forget(self.buf.take());
            None
        }
    }
}

impl Drop for UserMr {
    fn drop(&mut self) {
        if let Some(home) = self.home.take() {
            if let Some(cache) = home.cache() {
                if !self.mr.is_null() && self.buf.is_some() {
                    // Still registered, in no work request: back to the
                    // cache, which takes over the registration (a closed
                    // cache drops it without its home: deregistered then).
                    let back = UserMr {
                        mr: std::mem::replace(&mut self.mr, std::ptr::null_mut()),
                        buf: self.buf.take(),
                        addr: self.addr,
                        len: self.len,
                        how: self.how,
                        pd: self.pd.clone(),
                        home: Some(home),
                    };
                    cache.put(back);
                    return;
                }
            }
        }
        if !self.deregister() {
            std::mem::forget(self.buf.take());
        }
    }
}

/// A second registration of part of a buffer a [`UserMr`] owns, with
/// local write and `MW_BIND` (wire protocol §5.7): a type-2 window bound
/// over all of it grants a peer exactly those bytes, on every device (rxe
/// checks a window's accesses against its MR's range, not the window's).
/// It counts no bytes against the cap (the owner's registration does).
pub(crate) struct SubMr {
    mr: *mut ibv_mr,
    addr: u64,
    len: usize,
}

// SAFETY: the MR pointer is only passed to thread-safe libibverbs calls;
// the memory belongs to the owner the caller of `new` keeps.
unsafe impl Send for SubMr {}

impl SubMr {
    /// Registers `[addr, addr + len)` in `pd`.
    ///
    /// # Safety
    ///
    /// The range lies inside a live buffer that stays allocated (and is
    /// neither freed nor handed to the application) until this `SubMr` is
    /// deregistered ([`deregister`](Self::deregister) returned `true`, or
    /// it was dropped after its QP was destroyed).
    pub(crate) unsafe fn new(pd: &Arc<Pd>, addr: u64, len: usize) -> Result<SubMr, Error> {
        use ibv_access_flags as f;
        let flags = f::IBV_ACCESS_LOCAL_WRITE.0 | f::IBV_ACCESS_MW_BIND.0;
        // SAFETY: the range is live memory (the caller's contract); pd is live.
        let mr = unsafe { ibv_reg_mr(pd.ptr, addr as *mut std::ffi::c_void, len, flags as i32) };
        if mr.is_null() {
            return Err(Error::ResourceLimit(ResourceError::from_error(verb_err(
                "ibv_reg_mr",
            ))));
        }
        crate::stats::GLOBAL
            .memory_registrations
            .fetch_add(1, Ordering::Relaxed);
        Ok(SubMr { mr, addr, len })
    }

    /// The MR, to bind a window over.
    pub(crate) fn mr(&self) -> *mut ibv_mr {
        self.mr
    }

    /// (address, length) of the bytes it covers.
    pub(crate) fn range(&self) -> (u64, u64) {
        (self.addr, self.len as u64)
    }

    /// Deregisters it: `false` if that failed (then the device may still
    /// map the buffer, which must never be freed nor handed out).
    pub(crate) fn deregister(mut self) -> bool {
        let mr = std::mem::replace(&mut self.mr, std::ptr::null_mut());
        // SAFETY: mr came from ibv_reg_mr and is deregistered once (then null).
        let r = unsafe { ibv_dereg_mr(mr) };
        if r != 0 {
            tracing::warn!(
                "ibv_dereg_mr of a destination's grant of {} bytes failed: {}",
                self.len,
                crate::error::Errno(r)
            );
        }
        r == 0
    }
}

impl Drop for SubMr {
    fn drop(&mut self) {
        if self.mr.is_null() {
            return;
        }
        // SAFETY: as in `deregister`. Reached only when the connection is torn
        // down (its QP gone, its window deallocated first): no access can use it.
        let r = unsafe { ibv_dereg_mr(self.mr) };
        if r != 0 {
            tracing::warn!(
                "ibv_dereg_mr of a destination's grant failed: {}",
                crate::error::Errno(r)
            );
        }
    }
}

impl Exposable {
    /// The bytes of an `Owned` buffer after a READ into it.
    pub(crate) fn into_bytes(self) -> Bytes {
        match self {
            Exposable::Shared(b) => b,
            Exposable::Owned(b) => b.freeze(),
        }
    }
}

/// A READ's destination: `len` zeroed bytes.
pub(crate) fn read_destination(len: usize) -> Exposable {
    Exposable::Owned(BytesMut::zeroed(len))
}

/// The bit of a fenced WRITE's work request id ([`SideQp::post`]): its
/// successful completion is not the operation's (the fence READ's is).
pub(crate) const FENCED_WRITE: u64 = 1 << 63;

/// What one READ or WRITE moves ([`SideQp::post`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Transfer {
    /// A READ (else a WRITE).
    pub(crate) read: bool,
    /// Bytes: the first `len` of the local buffer.
    pub(crate) len: usize,
    /// The peer's address and key.
    pub(crate) remote_addr: u64,
    pub(crate) rkey: u32,
}

/// READs of at most this many bytes may land in the side queue pair's
/// own buffer ([`SideQp::post_small_read`]) and be copied out when they
/// complete: no local buffer is taken or given back for them.
pub(crate) const SMALL_READ_MAX: usize = 4096;

/// The local end of a posted READ or WRITE, kept by the [`SideQp`] until
/// its completion is polled.
pub(crate) enum Local {
    /// A registered buffer of the caller's.
    Mr(UserMr),
    /// A READ of at most [`SMALL_READ_MAX`] bytes into the queue pair's
    /// own buffer ([`SideQp::post_small_read`]).
    Small,
}

/// Why [`SideQp::post`] failed.
pub(crate) enum PostFail {
    /// Nothing was posted: the buffer, and why.
    NotPosted(UserMr, Error),
    /// The WRITE was posted but its fence could not be: the buffer stays
    /// posted (its completion, or the QP's destruction, ends it) and the
    /// QP was moved to the error state.
    Posted(Error),
}

/// What a side queue pair keeps per posted work request, by its id: at
/// most the queue pair's depth (64) entries, so a short list (a lookup is a
/// few compares, no hashing per operation).
pub(crate) struct ByWrId<T>(Vec<(u64, T)>);

impl<T> Default for ByWrId<T> {
    fn default() -> Self {
        ByWrId(Vec::new())
    }
}

impl<T> ByWrId<T> {
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    pub(crate) fn contains(&self, wr_id: u64) -> bool {
        self.0.iter().any(|(id, _)| *id == wr_id)
    }

    /// Adds `v` for `wr_id` (the caller made sure it is not there).
    pub(crate) fn insert(&mut self, wr_id: u64, v: T) {
        self.0.push((wr_id, v));
    }

    pub(crate) fn remove(&mut self, wr_id: u64) -> Option<T> {
        let i = self.0.iter().position(|(id, _)| *id == wr_id)?;
        Some(self.0.swap_remove(i).1)
    }
}

/// The side queue pair of a connection (wire protocol §10.2) and every
/// buffer posted on it: a posted [`UserMr`] stays here until
/// [`SideQp::complete`] is called for its polled completion, or the QP is
/// destroyed ([`SideQp::destroy`], or dropping: the QP goes first).
pub(crate) struct SideQp {
    /// First: destroyed before the buffers below are deregistered.
    qp: Qp,
    posted: ByWrId<UserMr>,
    /// The queue pair's own buffer ([`SMALL_READ_MAX`] bytes, local write
    /// only: the peer has no key to it): the sink of every fence READ
    /// (zero bytes: nothing is written to it, but a READ's sink must allow
    /// local write) and the destination of one small READ at a time.
    scratch: UserMr,
    /// The small READ posted into `scratch`: its work request id and
    /// length. The CPU does not touch `scratch` meanwhile.
    small: Option<(u64, usize)>,
    /// The length of the small READ whose successful completion was polled
    /// last, until [`SideQp::small_bytes`] copies it out.
    landed: Option<usize>,
}

impl SideQp {
    /// `scratch`: a [`MrUse::ReadDestination`] of at least
    /// [`SMALL_READ_MAX`] bytes in the QP's PD.
    pub(crate) fn new(qp: Qp, scratch: UserMr) -> SideQp {
        debug_assert!(scratch.len >= SMALL_READ_MAX && scratch.is_read_destination());
        SideQp {
            qp,
            posted: ByWrId::default(),
            scratch,
            small: None,
            landed: None,
        }
    }

    /// Whether a small READ can be posted now ([`Self::post_small_read`]).
    pub(crate) fn small_free(&self) -> bool {
        self.small.is_none()
    }

    /// Posts a signaled READ of `t.len` (at most [`SMALL_READ_MAX`]) bytes
    /// into the queue pair's own buffer; its bytes are copied out by
    /// [`Self::small_bytes`] once its completion was polled
    /// ([`Self::complete`]). One at a time.
    pub(crate) fn post_small_read(&mut self, wr_id: u64, t: Transfer) -> Result<(), Error> {
        if !t.read
            || t.len > self.scratch.len
            || self.small.is_some()
            || self.posted.contains(wr_id)
            || wr_id & FENCED_WRITE != 0
        {
            return Err(Error::Remote(RemoteError::Unavailable(
                "internal: a small READ that does not fit, or one already posted".into(),
            )));
        }
        let d = OneSidedDesc {
            wr_id,
            read: true,
            addr: self.scratch.addr,
            len: t.len as u32,
            lkey: self.scratch.lkey(),
            remote_addr: t.remote_addr,
            rkey: t.rkey,
        };
        // `scratch` stays the QP's until after it is destroyed (a field after
        // `qp`); the CPU reads it only in `small_bytes`, after `complete`
        // cleared `small`, and fence READs write none of it.
        // SAFETY: `scratch` is registered with local write on this QP's PD,
        // `t.len` is within it (checked above), and it is untouched by the
        // CPU until this READ completes or the QP is destroyed (see above).
        unsafe { self.qp.post_one_sided(&d) }?;
        self.small = Some((wr_id, t.len));
        self.landed = None;
        Ok(())
    }

    /// The bytes the last small READ brought, copied out; `None` unless its
    /// successful completion was just polled ([`Self::complete`] with
    /// `ok`).
    pub(crate) fn small_bytes(&mut self) -> Option<Bytes> {
        let len = self.landed.take()?;
        crate::stats::GLOBAL
            .small_reads_in_place
            .fetch_add(1, Ordering::Relaxed);
        Some(Bytes::copy_from_slice(&self.scratch.local_bytes()[..len]))
    }

    /// Posts a signaled READ (into `local`, which must be a
    /// [`MrUse::ReadDestination`]) or WRITE (from `local`, a local buffer:
    /// [`MrUse::WriteSource`] or a cached [`MrUse::ReadDestination`]) of
    /// the first `t.len` bytes of `local`, to `[t.remote_addr, +t.len)`
    /// with `t.rkey`; `local` stays here until `wr_id` completes. On failure it is
    /// given back.
    ///
    /// With `fence` (a WRITE on iWARP, where a WRITE completes once sent,
    /// before the peer checked it, §10.3) the WRITE is posted with
    /// `wr_id | `[`FENCED_WRITE`] and followed by a zero-length READ at the
    /// same place with `wr_id`: the peer answers it only after it placed
    /// the WRITE, so its completion is the WRITE's, and a WRITE the peer
    /// refused fails it.
    pub(crate) fn post(
        &mut self,
        wr_id: u64,
        fence: bool,
        local: UserMr,
        t: Transfer,
    ) -> Result<(), Box<PostFail>> {
        let Transfer {
            read,
            len,
            remote_addr,
            rkey,
        } = t;
        let kind_ok = match local.how {
            MrUse::ReadDestination => true,
            MrUse::WriteSource => !read,
            MrUse::Exposed(_) | MrUse::WindowSource => false,
        };
        if !kind_ok || len > local.len || self.posted.contains(wr_id) || wr_id & FENCED_WRITE != 0 {
            return Err(Box::new(PostFail::NotPosted(
                local,
                Error::Remote(RemoteError::Unavailable(
                    "internal: a buffer of the wrong kind or size, or a reused work request id"
                        .into(),
                )),
            )));
        }
        let Ok(len) = u32::try_from(len) else {
            let e = Error::Remote(RemoteError::TooLarge {
                len: len as u64,
                max: u32::MAX.into(),
            });
            return Err(Box::new(PostFail::NotPosted(local, e)));
        };
        let d = OneSidedDesc {
            wr_id: if fence && !read {
                wr_id | FENCED_WRITE
            } else {
                wr_id
            },
            read,
            addr: local.addr,
            len,
            lkey: local.lkey(),
            remote_addr,
            rkey,
        };
        // `local` moves into `posted` right after a successful post and leaves
        // only by `complete` (the completion of its last work request, `wr_id`,
        // was polled: send queue order means the fenced WRITE before it
        // completed too) or after the QP is destroyed.
        // SAFETY: `local` is registered on this QP's PD (the exposure PD), with
        // local write for a READ and `len` within it (checked above: `how`,
        // `len`); it stays posted as said just above, untouched by the CPU.
        if let Err(e) = unsafe { self.qp.post_one_sided(&d) } {
            return Err(Box::new(PostFail::NotPosted(local, e)));
        }
        if fence && !read {
            let f = OneSidedDesc {
                wr_id,
                read: true,
                addr: self.scratch.addr,
                len: 0,
                lkey: self.scratch.lkey(),
                ..d
            };
            // SAFETY: a zero-length READ into `scratch`, registered with
            // local write on this QP's PD and kept until the QP is
            // destroyed (a field after `qp`); the NIC writes none of it.
            if let Err(e) = unsafe { self.qp.post_one_sided(&f) } {
                // The WRITE is posted: its buffer stays until its
                // completion is polled or the QP is destroyed, whatever the
                // caller does; the QP cannot be trusted any more.
                self.posted.insert(wr_id, local);
                let _ = self.qp.to_error();
                return Err(Box::new(PostFail::Posted(e)));
            }
        }
        self.posted.insert(wr_id, local);
        Ok(())
    }

    /// The local end of `wr_id`, whose completion was just polled (`ok`:
    /// successfully; then a small READ's bytes are ready for
    /// [`Self::small_bytes`]).
    pub(crate) fn complete(&mut self, wr_id: u64, ok: bool) -> Option<Local> {
        match self.small {
            Some((id, len)) if id == wr_id => {
                self.small = None;
                self.landed = ok.then_some(len);
                Some(Local::Small)
            }
            _ => self.posted.remove(wr_id).map(Local::Mr),
        }
    }

    /// Work requests posted whose completion was not polled yet.
    pub(crate) fn outstanding(&self) -> usize {
        self.posted.len() + usize::from(self.small.is_some())
    }

    /// Moves the QP to the error state: every posted work request is
    /// flushed (completes with IBV_WC_WR_FLUSH_ERR).
    pub(crate) fn to_error(&self) -> Result<(), Error> {
        self.qp.to_error()
    }

    /// Destroys the QP, then gives back the buffers whose completion never
    /// came (safe now: after `rdma_destroy_qp` the NIC no longer touches
    /// them).
    pub(crate) fn destroy(self) -> Vec<(u64, Local)> {
        let SideQp {
            qp,
            posted,
            scratch,
            small,
            ..
        } = self;
        drop(qp);
        drop(scratch);
        let mut left: Vec<(u64, Local)> = posted
            .0
            .into_iter()
            .map(|(id, mr)| (id, Local::Mr(mr)))
            .collect();
        left.extend(small.map(|(id, _)| (id, Local::Small)));
        left
    }
}
