//! The one-sided state of one connection (§10): its exposure PD (made on
//! first use), the bytes it exposes, the side queue pair in use (a
//! [`SideLink`] to its task) and how an operation gets one: the active
//! side opens it, the listener side waits for the active side to.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::watch;

use crate::config::Config;
use crate::conn::{NotTaken, Reply, SideCore};
use crate::engine::wire::{Hello, SideToken};
use crate::error::{Error, RemoteError, ResourceError};
use crate::mem::{read_buffer, Local, LocalCache, UserMr};
use crate::verbs::cm::CmId;
use crate::verbs::Pd;

/// Which end of the connection this is.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Role {
    /// The side that called `connect`: opens the side queue pair, to the
    /// listener at `peer`, from `local`.
    Active {
        peer: SocketAddr,
        local: Option<IpAddr>,
    },
    /// The listener's side: waits for the active side to open it.
    Passive,
}

/// One READ or WRITE: what to move, and the buffer to move it from or to.
pub(crate) struct OpSpec {
    pub(crate) read: bool,
    pub(crate) local: Local,
    /// Bytes moved: the first `len` of `local`.
    pub(crate) len: usize,
    pub(crate) remote_addr: u64,
    pub(crate) rkey: u32,
}

/// One READ or WRITE handed to a side queue pair, which owns it (and its
/// buffer) until its completion is polled, and where its answer goes.
pub(crate) struct Op {
    pub(crate) spec: OpSpec,
    pub(crate) reply: Reply,
}

/// How an [`Op`] ended.
pub(crate) enum OpResult {
    /// Completed.
    Done(Finished),
    /// Flushed (or never posted) because the side queue pair failed: may
    /// be retried on a fresh one. `true`: its completion was the queue
    /// pair's first failed one (the likely cause, §10.3).
    Flushed(Local, bool),
    /// Failed for good.
    Failed(Error),
}

/// What a completed operation gives back.
pub(crate) enum Finished {
    /// The local buffer, still registered.
    Mr(UserMr),
    /// A small READ's bytes, copied out of the queue pair's own buffer
    /// ([`Local::Small`]).
    Read(Bytes),
}

/// A live side queue pair: its operations, which callers post and poll
/// themselves (`conn::side_core`).
#[derive(Clone)]
pub(crate) struct SideLink {
    pub(crate) core: Arc<SideCore>,
}

impl SideLink {
    /// The side queue pair's generation (which one of the connection's).
    pub(crate) fn gen(&self) -> u64 {
        self.core.gen
    }
}

/// The one-sided state of one connection, shared by its [`RemoteMemory`]
/// handles, its exposures, its driver (which closes it) and, on the
/// listener side, the listener (a `Weak`, to find it by its token).
///
/// [`RemoteMemory`]: super::RemoteMemory
pub(crate) struct RemoteShared {
    pub(crate) cfg: Config,
    pub(crate) role: Role,
    /// `None`: the peer does not offer one-sided access.
    pub(crate) token: Option<SideToken>,
    /// Our hello, sent again (with the side flag) on side requests.
    pub(crate) hello: Hello,
    /// The main connection's cm_id: its device is the exposure PD's.
    main_id: Arc<CmId>,
    /// The exposure PD, made on first use (under `init`).
    pd: OnceLock<Arc<Pd>>,
    /// The local buffers of READs and WRITEs (§10.5), made on first use
    /// (under `init`). Each operation finds both without a lock.
    cache: OnceLock<Arc<LocalCache>>,
    /// Held while `pd` or `cache` is made, and by [`Self::close`], so a
    /// cache made as the connection closes is closed too.
    init: Mutex<()>,
    exposed: Arc<AtomicUsize>,
    side: watch::Sender<Option<SideLink>>,
    /// Active side: one opener at a time.
    open_lock: tokio::sync::Mutex<()>,
    closed: watch::Sender<bool>,
    /// `closed`'s value, read without the watch's lock by every operation.
    is_closed: AtomicBool,
    next_gen: AtomicU64,
}

/// Bytes counted against `Config::max_exposed_bytes`, given back on drop.
pub(crate) struct Counted {
    bytes: usize,
    total: Arc<AtomicUsize>,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.total.fetch_sub(self.bytes, Ordering::SeqCst);
    }
}

impl RemoteShared {
    pub(crate) fn new(
        cfg: &Config,
        role: Role,
        token: Option<SideToken>,
        hello: Hello,
        main_id: Arc<CmId>,
    ) -> Arc<RemoteShared> {
        Arc::new(RemoteShared {
            cfg: cfg.clone(),
            role,
            token,
            hello,
            main_id,
            pd: OnceLock::new(),
            cache: OnceLock::new(),
            init: Mutex::new(()),
            exposed: Arc::default(),
            side: watch::Sender::new(None),
            open_lock: tokio::sync::Mutex::new(()),
            closed: watch::Sender::new(false),
            is_closed: AtomicBool::new(false),
            next_gen: AtomicU64::new(1),
        })
    }

    /// Ends one-sided access: the connection is closed. The side queue
    /// pair's task stops (and disconnects it); exposures stay registered
    /// until revoked or dropped, but no queue pair can reach them.
    pub(crate) fn close(&self) {
        self.is_closed.store(true, Ordering::SeqCst);
        self.closed.send_replace(true);
        self.side.send_replace(None);
        // Kept (closed): its buffers still in use count until dropped.
        let _g = self.init.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = self.cache.get() {
            c.close();
        }
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.is_closed.load(Ordering::SeqCst)
    }

    /// The side queue pair in use, watched: a side task whose generation
    /// is no longer the one in use stops (a newer one replaced it).
    pub(crate) fn side_watch(&self) -> watch::Receiver<Option<SideLink>> {
        self.side.subscribe()
    }

    pub(crate) fn closed_watch(&self) -> watch::Receiver<bool> {
        self.closed.subscribe()
    }

    /// `Ok` when operations may proceed: open, and offered by the peer.
    /// Whether the connection's device is iWARP (§10.5: small READs that
    /// cross a page boundary are split there).
    pub(crate) fn iwarp(&self) -> bool {
        self.main_id.is_iwarp()
    }

    pub(crate) fn usable(&self) -> Result<(), Error> {
        if self.is_closed() {
            return Err(Error::Remote(RemoteError::Closed));
        }
        if self.token.is_none() {
            return Err(Error::Remote(RemoteError::Unavailable(
                "the peer does not offer one-sided access".into(),
            )));
        }
        Ok(())
    }

    /// The exposure PD, allocated on first use on the main connection's
    /// device: only this connection's side queue pairs are in it (§10.1).
    pub(crate) fn pd(&self) -> Result<&Arc<Pd>, Error> {
        if let Some(pd) = self.pd.get() {
            return Ok(pd);
        }
        let _g = self.init.lock().unwrap_or_else(|p| p.into_inner());
        self.pd_locked()
    }

    /// [`Self::pd`] under `init`.
    fn pd_locked(&self) -> Result<&Arc<Pd>, Error> {
        if let Some(pd) = self.pd.get() {
            return Ok(pd);
        }
        let pd = Pd::new(self.main_id.clone())
            .map_err(|e| Error::ResourceLimit(ResourceError::from_error(e)))?;
        Ok(self.pd.get_or_init(|| pd))
    }

    /// The cache of local buffers (§10.5), in the exposure PD.
    pub(crate) fn cache(&self) -> Result<&Arc<LocalCache>, Error> {
        if let Some(c) = self.cache.get() {
            return Ok(c);
        }
        let _g = self.init.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = self.cache.get() {
            return Ok(c);
        }
        let c = LocalCache::new(
            self.pd_locked()?.clone(),
            self.cfg.one_sided_cache_bytes,
            self.cfg.global_max_registered_bytes,
        );
        if !self.is_closed() {
            Ok(self.cache.get_or_init(|| c))
        } else {
            // Closed (under `init`, so `close` has run): not kept.
            c.close();
            Err(Error::Remote(RemoteError::Closed))
        }
    }

    /// Bytes of the cache's local buffers, free or in use.
    pub(crate) fn cached_bytes(&self) -> usize {
        self.cache.get().map_or(0, |c| c.bytes())
    }

    /// The exposure PD's device is `id`'s.
    pub(crate) fn same_device(&self, id: &CmId) -> bool {
        std::ptr::eq(id.verbs(), self.main_id.verbs())
    }

    pub(crate) fn exposed(&self) -> usize {
        self.exposed.load(Ordering::SeqCst)
    }

    /// Counts `len` more exposed bytes, within `Config::max_exposed_bytes`.
    pub(crate) fn count_exposed(&self, len: usize) -> Result<Counted, Error> {
        let cap = self.cfg.max_exposed_bytes;
        let prev = self.exposed.fetch_add(len, Ordering::SeqCst);
        if prev.checked_add(len).is_none_or(|t| t > cap) {
            self.exposed.fetch_sub(len, Ordering::SeqCst);
            return Err(Error::ResourceLimit(ResourceError::ExposedBytes {
                requested: len,
                cap,
                in_use: prev,
            }));
        }
        Ok(Counted {
            bytes: len,
            total: self.exposed.clone(),
        })
    }

    pub(crate) fn next_gen(&self) -> u64 {
        self.next_gen.fetch_add(1, Ordering::Relaxed)
    }

    /// Makes `link` the side queue pair in use (unless closed meanwhile:
    /// then `false`, and the caller's task stops).
    pub(crate) fn install(&self, link: SideLink) -> bool {
        if self.is_closed() {
            return false;
        }
        self.side.send_replace(Some(link));
        // close() may have run between the check and the send.
        if self.is_closed() {
            self.side.send_replace(None);
            return false;
        }
        true
    }

    /// The side queue pair of generation `gen` failed: no longer in use.
    pub(crate) fn side_failed(&self, gen: u64) {
        self.side.send_if_modified(|s| {
            if s.as_ref().is_some_and(|l| l.gen() == gen) {
                *s = None;
                true
            } else {
                false
            }
        });
    }

    fn current(&self, not: Option<u64>) -> Option<SideLink> {
        self.side
            .borrow()
            .as_ref()
            .filter(|l| Some(l.gen()) != not)
            .cloned()
    }

    /// A live side queue pair other than generation `not`: the current one;
    /// else, on the active side, a new one (opened now); on the listener
    /// side, the one the active side opens within `connect_timeout`.
    pub(crate) async fn side(self: &Arc<Self>, not: Option<u64>) -> Result<SideLink, Error> {
        self.usable()?;
        if let Some(l) = self.current(not) {
            return Ok(l);
        }
        let token = self.token.expect("usable() checked the token");
        match self.role {
            Role::Active { peer, local } => {
                let _g = self.open_lock.lock().await;
                if let Some(l) = self.current(not) {
                    return Ok(l);
                }
                self.usable()?;
                crate::conn::open_side(self, peer, local, token).await
            }
            Role::Passive => {
                let mut rx = self.side.subscribe();
                let mut closed = self.closed.subscribe();
                let wait = async {
                    tokio::select! {
                        r = rx.wait_for(|s| s.as_ref().is_some_and(|l| Some(l.gen()) != not)) => {
                            r.ok().and_then(|s| s.clone())
                        }
                        _ = closed.wait_for(|c| *c) => None,
                    }
                };
                match tokio::time::timeout(self.cfg.connect_timeout, wait).await {
                    Ok(Some(l)) => Ok(l),
                    Ok(None) => Err(Error::Remote(RemoteError::Closed)),
                    Err(_) => Err(Error::Remote(RemoteError::Unavailable(format!(
                        "the peer opened no side queue pair within connect_timeout ({:?})",
                        self.cfg.connect_timeout
                    )))),
                }
            }
        }
    }

    /// Runs one READ or WRITE: on the current side queue pair, and once
    /// more on a fresh one if it failed under the operation without the
    /// operation being the cause (§10.3).
    pub(crate) async fn run(
        self: &Arc<Self>,
        read: bool,
        local: Local,
        len: usize,
        remote_addr: u64,
        rkey: u32,
    ) -> Result<Finished, Error> {
        let mut local = local;
        let mut failed: Option<u64> = None;
        // Times the queue pair failed first at this operation: twice on two
        // queue pairs means the peer's NIC refuses it (iWARP reports a
        // refused operation by a flush, §10.3).
        let mut first_failures = 0;
        // Up to five tries: an operation beside a refused one may land behind
        // it again on the fresh queue pair (iWARP), while the refused one
        // itself ends after its second suspected failure.
        for attempt in 0..5 {
            if attempt > 0 {
                crate::stats::GLOBAL
                    .one_sided_retries
                    .fetch_add(1, Ordering::Relaxed);
            }
            let link = self.side(failed).await?;
            let spec = OpSpec {
                read,
                local,
                len,
                remote_addr,
                rkey,
            };
            let mut submitted = link.core.submit(spec);
            if let Err(NotTaken::NeedsBuffer(spec)) = submitted {
                // A small READ that cannot use the queue pair's own buffer
                // now (others are posted): it takes a local buffer.
                let mr = read_buffer(
                    self.cache()?,
                    spec.len,
                    self.pd()?,
                    self.cfg.global_max_registered_bytes,
                )?;
                submitted = link.core.submit(OpSpec {
                    local: Local::Mr(mr),
                    ..*spec
                });
            }
            let answer = match submitted {
                Ok(a) => a,
                Err(NotTaken::Closed(spec) | NotTaken::NeedsBuffer(spec)) => {
                    // The queue pair failed before we posted.
                    local = spec.local;
                    failed = Some(link.gen());
                    continue;
                }
            };
            match link.core.wait(answer).await {
                Some(OpResult::Done(l)) => return Ok(l),
                Some(OpResult::Flushed(l, first)) => {
                    local = l;
                    failed = Some(link.gen());
                    if first {
                        first_failures += 1;
                        if first_failures == 2 {
                            return Err(Error::Remote(RemoteError::Refused {
                                status: "the side queue pair failed at this operation twice, \
                                         on two queue pairs (a flush: the device reports no \
                                         remote access error)"
                                    .into(),
                            }));
                        }
                    }
                }
                Some(OpResult::Failed(e)) => return Err(e),
                // The task never drops an op without replying; should it
                // (a runtime shutting down), the buffer went with it.
                None => {
                    return Err(Error::Remote(RemoteError::Unavailable(
                        "the side queue pair's task ended".into(),
                    )))
                }
            }
        }
        drop(local);
        if self.is_closed() {
            return Err(Error::Remote(RemoteError::Closed));
        }
        Err(Error::Remote(RemoteError::Unavailable(
            "the side queue pair failed five times under this operation".into(),
        )))
    }

    /// After the side queue pair of the active side failed: opens a fresh
    /// one in the background (no sooner than a second after the last
    /// attempt), so that the listener side's operations, which cannot open
    /// one, find one.
    pub(crate) fn reopen_later(self: &Arc<Self>) {
        self.open_in_background(Duration::from_secs(1));
    }

    /// On the active side, without a side queue pair: opens one in the
    /// background after `delay` (an exposure of ours is about to be used by
    /// the listener side, which waits for one).
    pub(crate) fn open_in_background(self: &Arc<Self>, delay: Duration) {
        if !matches!(self.role, Role::Active { .. })
            || self.is_closed()
            || self.token.is_none()
            || self.current(None).is_some()
        {
            return;
        }
        let weak: Weak<RemoteShared> = Arc::downgrade(self);
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let Some(s) = weak.upgrade() else { return };
            if s.is_closed() || s.current(None).is_some() {
                return;
            }
            if let Err(e) = s.side(None).await {
                tracing::debug!("rdma: reopening the side queue pair failed: {e}");
            }
        });
    }
}
