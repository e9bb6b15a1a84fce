//! The local buffers of one-sided READs and WRITEs, kept registered
//! between operations (wire protocol §10.5): registering a buffer per
//! operation costs two system calls and pins its pages each time, which
//! outweighs a small transfer and a quarter of a 1 MiB one.
//!
//! A [`LocalCache`] belongs to one connection's exposure PD. It keeps
//! buffers of power-of-two sizes from 4 KiB to 4 MiB ([`class_of`]), at
//! most `Config::one_sided_cache_bytes` of them in all (free or in use);
//! a READ or WRITE takes the smallest that fits, or is registered on the
//! fly beyond that. A buffer goes back to the cache when its
//! [`UserMr`] is dropped, wherever that happens (a completed operation,
//! a flushed one, the `Bytes` handed up by [`read_bytes`]), and is
//! deregistered when the cache is closed.
//!
//! The buffers are local: the peer has no key to them (registered with
//! local write only), and only our own work requests touch them, so their
//! bytes may be read and written whenever no work request holds them
//! (`UserMr`'s doc).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use bytes::{Bytes, BytesMut};

use super::exposed::{MrUse, UserMr};
use crate::error::Error;
use crate::remote::Exposable;
use crate::verbs::Pd;

/// log2 of the smallest cached buffer (4 KiB).
const MIN_CLASS: u32 = 12;
/// log2 of the largest cached buffer (4 MiB): larger transfers register
/// their buffer on the fly, which amortizes over their size.
const MAX_CLASS: u32 = 22;
const CLASSES: usize = (MAX_CLASS - MIN_CLASS + 1) as usize;

/// READs of at most this many bytes are copied out of their cached buffer,
/// which goes back at once; longer ones hand the buffer itself up.
pub(crate) const COPY_OUT_MAX: usize = 4096;

/// WRITEs of at most this many bytes are copied into a cached buffer;
/// longer ones register the application's bytes on the fly (no copy).
pub(crate) const COPY_IN_MAX: usize = 64 << 10;

/// The size class of a `len`-byte buffer: `None` above [`MAX_CLASS`].
fn class_of(len: usize) -> Option<u32> {
    let c = len
        .max(1)
        .checked_next_power_of_two()?
        .trailing_zeros()
        .max(MIN_CLASS);
    (c <= MAX_CLASS).then_some(c)
}

/// Where a cached buffer goes back to, and its share of the cache's bytes
/// (given back when the buffer is deregistered).
pub(crate) struct Home {
    cache: Weak<LocalCache>,
    bytes: usize,
    owned: Arc<AtomicUsize>,
}

impl Home {
    /// The cache, if it still exists.
    pub(crate) fn cache(&self) -> Option<Arc<LocalCache>> {
        self.cache.upgrade()
    }
}

impl Drop for Home {
    fn drop(&mut self) {
        self.owned.fetch_sub(self.bytes, Ordering::SeqCst);
    }
}

struct Free {
    /// Free buffers by class (index `class - MIN_CLASS`).
    by_class: [Vec<UserMr>; CLASSES],
    closed: bool,
}

/// The registered local buffers of one connection's one-sided operations.
pub(crate) struct LocalCache {
    pd: Arc<Pd>,
    /// Bytes each buffer has beyond its power of two (a message's head
    /// before a power-of-two payload, wire protocol §5.6).
    slack: usize,
    /// `Config::one_sided_cache_bytes`.
    cap: usize,
    /// `Config::global_max_registered_bytes`.
    global_limit: usize,
    /// Bytes of the cache's buffers, free or in use.
    owned: Arc<AtomicUsize>,
    free: Mutex<Free>,
    me: Weak<LocalCache>,
}

impl LocalCache {
    pub(crate) fn new(pd: Arc<Pd>, cap: usize, global_limit: usize) -> Arc<LocalCache> {
        Self::with_slack(pd, cap, global_limit, 0)
    }

    /// As [`new`](Self::new), with buffers of `2^k + slack` bytes: a
    /// power-of-two payload behind a head of up to `slack` bytes fits the
    /// class of the payload, not twice it.
    pub(crate) fn with_slack(
        pd: Arc<Pd>,
        cap: usize,
        global_limit: usize,
        slack: usize,
    ) -> Arc<LocalCache> {
        Arc::new_cyclic(|me| LocalCache {
            pd,
            slack,
            cap,
            global_limit,
            owned: Arc::default(),
            free: Mutex::new(Free {
                by_class: Default::default(),
                closed: false,
            }),
            me: me.clone(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Free> {
        self.free.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A registered local buffer of at least `len` bytes, kept by the cache
    /// (it goes back when dropped): a free one, or a new one while the
    /// cache has room. `Ok(None)` when `len` is above the largest class or
    /// the cache is full or closed: the caller registers on the fly.
    ///
    /// # Errors
    ///
    /// [`Error::ResourceLimit`] when a new buffer cannot be registered.
    pub(crate) fn take(&self, len: usize) -> Result<Option<UserMr>, Error> {
        let Some(class) = class_of(len.saturating_sub(self.slack)) else {
            return Ok(None);
        };
        let size = (1usize << class) + self.slack;
        {
            let mut g = self.lock();
            if g.closed {
                return Ok(None);
            }
            if let Some(mr) = g.by_class[(class - MIN_CLASS) as usize].pop() {
                return Ok(Some(mr));
            }
        }
        let prev = self.owned.fetch_add(size, Ordering::SeqCst);
        let home = Home {
            cache: self.me.clone(),
            bytes: size,
            owned: self.owned.clone(),
        };
        if prev + size > self.cap {
            drop(home);
            return Ok(None);
        }
        let mut mr = UserMr::new(
            &self.pd,
            Exposable::Owned(BytesMut::zeroed(size)),
            MrUse::ReadDestination,
            self.global_limit,
        )?;
        mr.set_home(Some(home));
        Ok(Some(mr))
    }

    /// Takes back a buffer of the cache (from `UserMr`'s drop); a closed
    /// cache lets it go (deregistered).
    pub(crate) fn put(&self, mut mr: UserMr) {
        let Some(class) = class_of(mr.len().saturating_sub(self.slack)) else {
            mr.set_home(None);
            return;
        };
        let mut g = self.lock();
        if g.closed {
            drop(g);
            mr.set_home(None);
            return;
        }
        g.by_class[(class - MIN_CLASS) as usize].push(mr);
    }

    /// Deregisters the free buffers; those in use are deregistered when
    /// dropped. Called when the connection closes.
    pub(crate) fn close(&self) {
        let free = {
            let mut g = self.lock();
            g.closed = true;
            std::mem::take(&mut g.by_class)
        };
        for mut mr in free.into_iter().flatten() {
            mr.set_home(None);
        }
    }

    /// Bytes of the cache's buffers, free or in use.
    pub(crate) fn bytes(&self) -> usize {
        self.owned.load(Ordering::SeqCst)
    }
}

/// A READ's local buffer of `len` bytes: from `cache` when it has one,
/// else registered on the fly (exactly `len` bytes, zeroed).
pub(crate) fn read_buffer(
    cache: &LocalCache,
    len: usize,
    pd: &Arc<Pd>,
    global_limit: usize,
) -> Result<UserMr, Error> {
    if let Some(mr) = cache.take(len)? {
        return Ok(mr);
    }
    UserMr::new(
        pd,
        Exposable::Owned(BytesMut::zeroed(len)),
        MrUse::ReadDestination,
        global_limit,
    )
}

/// A WRITE's local buffer holding `data`: small data copied into a buffer
/// of `cache`, larger data (or with the cache full) registered where it is.
pub(crate) fn write_buffer(
    cache: &LocalCache,
    data: Bytes,
    pd: &Arc<Pd>,
    global_limit: usize,
) -> Result<UserMr, Error> {
    if data.len() <= COPY_IN_MAX {
        if let Some(mut mr) = cache.take(data.len())? {
            if let Some(dst) = mr.local_bytes_mut() {
                dst[..data.len()].copy_from_slice(&data);
                return Ok(mr);
            }
        }
    }
    UserMr::new(
        pd,
        Exposable::Shared(data),
        MrUse::WriteSource,
        global_limit,
    )
}

/// The first `len` bytes a completed READ wrote into `mr`, as `Bytes`:
/// copied out when short (the buffer goes back to its cache at once),
/// else the buffer itself, handed up (back to its cache when the last
/// `Bytes` over it is dropped); a buffer registered on the fly is
/// deregistered first. `None` if deregistering failed (the buffer is
/// leaked, never handed out).
pub(crate) fn read_bytes(mr: UserMr, len: usize) -> Option<Bytes> {
    if len <= COPY_OUT_MAX {
        return Some(Bytes::copy_from_slice(&mr.local_bytes()[..len]));
    }
    if mr.is_cached() {
        return Some(Bytes::from_owner(Filled { mr, len }));
    }
    let mut b = mr.into_inner()?.into_bytes();
    b.truncate(len);
    Some(b)
}

/// A cached buffer handed up after a READ filled its first `len` bytes.
struct Filled {
    mr: UserMr,
    len: usize,
}

impl AsRef<[u8]> for Filled {
    fn as_ref(&self) -> &[u8] {
        &self.mr.local_bytes()[..self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_powers_of_two_from_4_kib_to_4_mib() {
        assert_eq!(class_of(0), Some(12));
        assert_eq!(class_of(1), Some(12));
        assert_eq!(class_of(4096), Some(12));
        assert_eq!(class_of(4097), Some(13));
        assert_eq!(class_of(1 << 20), Some(20));
        assert_eq!(class_of((1 << 20) + 1), Some(21));
        assert_eq!(class_of(4 << 20), Some(22));
        assert_eq!(class_of((4 << 20) + 1), None);
        assert_eq!(class_of(usize::MAX), None);
    }
}
