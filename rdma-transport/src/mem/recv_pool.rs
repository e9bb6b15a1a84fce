//! A listener's shared receive pool ([`RecvPool`], wire protocol §4.7):
//! the receive buffers of every connection it accepted on one device,
//! posted to one shared receive queue, registered a chunk at a time as the
//! connections' credit limits grow, and taken back by a drain when many
//! more are posted than their credits need.

use std::sync::{Arc, Mutex};

use super::registered::{Access, RegisteredBuf};
use super::WR_SRQ;
use crate::error::{Error, NoDeviceReason, ResourceError};
use crate::verbs::cm::CmId;
use crate::verbs::{Cq, LoopQp, Pd, Srq};

/// wr_id kind tag of a shared receive pool's drain SEND (§4.7), on the
/// pool's own loopback QP.
const WR_DRAIN: u64 = 5;

/// Zero-length SENDs a drain posts at once (its QP's send queue depth).
const DRAIN_BATCH: usize = 64;

/// A drain starts at once when this many posted buffers are drainable (two
/// chunks); a smaller surplus is drained after [`DRAIN_SETTLE`].
const DRAIN_MIN: usize = 2 * CHUNK_BUFFERS;

/// How long a drain for a surplus below [`DRAIN_MIN`] waits before its first
/// round, so that connections closing together are drained by one run
/// rather than one run each. Without it, up to `DRAIN_MIN − 1` buffers no
/// credit stands for would stay posted until traffic consumed them.
const DRAIN_SETTLE: std::time::Duration = std::time::Duration::from_millis(50);

/// Buffers a drain may take back now: the drainable ones less one more
/// slack's worth, for the buffers closing connections' QPs took from the
/// SRQ and have not given back yet (they still count as posted).
fn drain_size<C>(st: &PoolState<C>) -> usize {
    st.drainable().saturating_sub(POOL_SLACK)
}

/// Buffers per registered chunk of a shared receive pool (128 KiB with
/// 8 KiB buffers).
const CHUNK_BUFFERS: usize = 16;

/// Buffers a shared receive pool keeps posted beyond the sum of its
/// connections' credit limits (§4.7): a peer that sends without credit
/// takes one of these, not a buffer another connection's credit stands for,
/// before the check closes its connection.
pub(crate) const POOL_SLACK: usize = 16;

/// The receive buffers of every connection a listener accepted on one
/// device, posted to one shared receive queue (wire protocol §4.7,
/// buffer-ownership.md "Shared receive pool").
///
/// Accounting: `reserved` is the sum of the connections' receive credit
/// limits (each connection's ring size as the engine sees it), `active`
/// the buffers posted to the SRQ or held by a connection (a message not yet
/// consumed). The pool keeps `active >= reserved + POOL_SLACK`, which is
/// the no-RNR rule of §4.2 summed over connections: every connection has
/// at most `limit − held` credits and messages in flight, so the posted
/// buffers cover them all. Buffers given back above that are not reposted;
/// a chunk none of whose buffers is posted or held is deregistered. Posted
/// buffers cannot be taken back from an SRQ: the pool shrinks as traffic
/// consumes them, and goes (SRQ, PD and chunks) with its last connection.
pub(crate) struct RecvPool {
    // Declared first: the drain's QP is destroyed before the SRQ it
    // receives from, and the SRQ before the chunks it may still have posted.
    drain: Mutex<Option<LoopQp>>,
    srq: Arc<Srq>,
    /// The cm_id of the connection that created the pool (its device
    /// context, port and address: for the drain's QP).
    anchor: Arc<CmId>,
    pd: Arc<Pd>,
    buf_bytes: usize,
    max_buffers: usize,
    global_limit: usize,
    state: Mutex<PoolState<Arc<RegisteredBuf>>>,
}

/// The shared pool's accounting, without verbs (host-tested): which
/// buffers to post, which chunks to register and which to let go. `C` is a
/// registered chunk (`Arc<RegisteredBuf>`; `()` in the tests).
struct PoolState<C> {
    chunks: Vec<Option<C>>,
    /// Per chunk, how many of its buffers are in `idle`.
    idle_in_chunk: Vec<usize>,
    /// Registered buffers neither posted nor held.
    idle: Vec<u32>,
    /// Σ of the connections' credit limits.
    reserved: usize,
    /// Buffers posted to the SRQ or held by a connection (less those a
    /// drain is taking back).
    active: usize,
    /// Per buffer, whether a connection holds it (its receive completed,
    /// the slot not reposted yet), and how many do.
    is_held: Vec<bool>,
    held: usize,
    /// A drain task runs (at most one per pool), or draining failed once
    /// (then never again for this pool).
    draining: bool,
    drain_off: bool,
    /// Posted buffers the running drain may still cycle through to pack
    /// what stays posted into fewer chunks ([`PoolState::compact`]); `None`
    /// until the drain has taken back all it may.
    compact_left: Option<usize>,
    /// Scratch list of buffers to post (kept: no allocation per repost).
    post: Vec<u32>,
}

impl<C> Default for PoolState<C> {
    fn default() -> Self {
        PoolState {
            chunks: Vec::new(),
            idle_in_chunk: Vec::new(),
            idle: Vec::new(),
            reserved: 0,
            active: 0,
            is_held: Vec::new(),
            held: 0,
            draining: false,
            drain_off: false,
            compact_left: None,
            post: Vec::new(),
        }
    }
}

impl<C> PoolState<C> {
    fn target(&self) -> usize {
        self.reserved + POOL_SLACK
    }

    fn registered(&self) -> usize {
        self.chunks.iter().flatten().count() * CHUNK_BUFFERS
    }

    /// Chunks to register before `reserve(n)` (0 when idle buffers cover
    /// it), or an error when they would exceed `max_buffers`.
    fn chunks_short(&self, n: usize, max_buffers: usize) -> Result<usize, usize> {
        let short = (self.target() + n).saturating_sub(self.active);
        let chunks = short
            .saturating_sub(self.idle.len())
            .div_ceil(CHUNK_BUFFERS);
        if self.registered() + chunks * CHUNK_BUFFERS > max_buffers {
            return Err(max_buffers);
        }
        Ok(chunks)
    }

    /// Adds a registered chunk; its buffers are idle.
    fn add_chunk(&mut self, c: C) {
        let k = match self.chunks.iter().position(Option::is_none) {
            Some(k) => k,
            None => {
                self.chunks.push(None);
                self.idle_in_chunk.push(0);
                self.chunks.len() - 1
            }
        };
        self.chunks[k] = Some(c);
        self.idle_in_chunk[k] = CHUNK_BUFFERS;
        self.is_held
            .resize(self.chunks.len() * CHUNK_BUFFERS, false);
        let base = (k * CHUNK_BUFFERS) as u32;
        self.idle
            .extend((0..CHUNK_BUFFERS as u32).rev().map(|j| base + j));
    }

    /// Raises the sum of limits by `n` and moves idle buffers to `post`
    /// until the target is met (the chunks were added first).
    fn reserve(&mut self, n: usize) {
        self.reserved += n;
        self.post.clear();
        while self.active < self.target() {
            let Some(b) = self.idle.pop() else {
                break; // not reached: chunks_short registered enough
            };
            self.idle_in_chunk[b as usize / CHUNK_BUFFERS] -= 1;
            self.post.push(b);
            self.active += 1;
        }
    }

    /// Takes back buffers a connection is done with: into `post` while at
    /// or below the target, idle above it, and a chunk whose buffers are
    /// all idle is let go (removed from `chunks`, so dropped).
    fn give_back(&mut self, bufs: &[u32]) {
        self.post.clear();
        for &b in bufs {
            if !self.ours(b) {
                continue; // never posted again
            }
            if std::mem::take(&mut self.is_held[b as usize]) {
                self.held -= 1;
            }
            if self.active > self.target() {
                self.active -= 1;
                self.make_idle(b);
            } else {
                self.post.push(b);
            }
        }
    }

    /// Whether `b` is a buffer of a registered chunk of this pool.
    fn ours(&self, b: u32) -> bool {
        self.chunks
            .get(b as usize / CHUNK_BUFFERS)
            .is_some_and(Option::is_some)
    }

    /// `b` (neither posted nor held any more) joins the idle buffers; a
    /// chunk whose buffers are then all idle is let go.
    fn make_idle(&mut self, b: u32) {
        let k = b as usize / CHUNK_BUFFERS;
        self.idle.push(b);
        self.idle_in_chunk[k] += 1;
        if self.idle_in_chunk[k] == CHUNK_BUFFERS {
            // No buffer of this chunk is posted or held: the NIC cannot
            // write it any more.
            self.idle.retain(|&i| i as usize / CHUNK_BUFFERS != k);
            self.idle_in_chunk[k] = 0;
            self.chunks[k] = None;
        }
    }

    /// A receive completion handed buffer `b` to a connection; whether it
    /// is one of ours.
    fn hold(&mut self, b: u32) -> bool {
        if !self.ours(b) || self.is_held[b as usize] {
            return false;
        }
        self.is_held[b as usize] = true;
        self.held += 1;
        true
    }

    /// Posted buffers beyond what the connections' credits and the slack
    /// need: every connection may still receive `limit − held` messages,
    /// so the SRQ must keep `reserved − held + slack` posted; the rest can
    /// be taken back by a drain.
    fn drainable(&self) -> usize {
        let posted = self.active.saturating_sub(self.held);
        posted.saturating_sub(self.reserved.saturating_sub(self.held) + POOL_SLACK)
    }

    /// Starts taking back `k` posted buffers (at most [`drainable`]): they
    /// leave `active` now, so nothing counts on them from here on.
    fn drain_start(&mut self, k: usize) {
        debug_assert!(k <= self.drainable());
        self.active -= k;
    }

    /// A drain consumed posted buffer `b` (its receive completed, or was
    /// flushed, on the drain's own QP): idle now.
    fn drained(&mut self, b: u32) {
        if self.ours(b) {
            self.make_idle(b);
        }
    }

    /// A drain that stopped with `k` of its buffers not consumed: they are
    /// still posted.
    fn drain_undo(&mut self, k: usize) {
        self.active += k;
    }

    /// Registered chunks.
    fn chunk_count(&self) -> usize {
        self.chunks.iter().flatten().count()
    }

    /// Whether what stays posted or held is spread over more chunks than
    /// it needs, by more than one: worth a compaction round.
    fn fragmented(&self) -> bool {
        self.chunk_count() > self.active.div_ceil(CHUNK_BUFFERS) + 1
    }

    /// One compaction round of at most `max` buffers (wire protocol §4.7,
    /// "The drain"): moves idle buffers of the chunks that are kept (the
    /// fullest, as many as `active` needs) to `post`, as replacements for
    /// as many of the oldest posted receives, which the drain then consumes
    /// ([`drain_start`](Self::drain_start) with the returned count). The
    /// SRQ hands out receives in the order they were posted, so cycling
    /// through the posted buffers once moves them all into the kept chunks
    /// and lets the others go. `active` is unchanged: the replacements are
    /// posted before the drain's SENDs, so the SRQ never holds fewer. 0:
    /// nothing to do (not fragmented, the cycle done, or no idle buffer in
    /// a kept chunk).
    fn compact(&mut self, max: usize) -> usize {
        let left = *self
            .compact_left
            .get_or_insert(self.active.saturating_sub(self.held));
        if left == 0 || !self.fragmented() {
            return 0;
        }
        // The chunks to keep: the fewest idle buffers first.
        let mut order: Vec<usize> = (0..self.chunks.len())
            .filter(|&k| self.chunks[k].is_some())
            .collect();
        order.sort_by_key(|&k| self.idle_in_chunk[k]);
        order.truncate(self.active.div_ceil(CHUNK_BUFFERS));
        let mut keep = vec![false; self.chunks.len()];
        for &k in &order {
            keep[k] = true;
        }
        let want = left.min(max);
        self.post.clear();
        let mut i = 0;
        while i < self.idle.len() && self.post.len() < want {
            let b = self.idle[i];
            let k = b as usize / CHUNK_BUFFERS;
            if keep[k] {
                self.idle.swap_remove(i);
                self.idle_in_chunk[k] -= 1;
                self.post.push(b);
            } else {
                i += 1;
            }
        }
        let n = self.post.len();
        self.active += n;
        self.compact_left = Some(left - n);
        n
    }
}

impl RecvPool {
    pub(crate) fn new(
        id: &Arc<CmId>,
        pd: Arc<Pd>,
        buf_bytes: usize,
        max_buffers: usize,
        global_limit: usize,
    ) -> Result<RecvPool, Error> {
        let max_buffers = max_buffers.max(CHUNK_BUFFERS);
        let srq = Arc::new(Srq::new(&pd, max_buffers as u32)?);
        Ok(RecvPool {
            drain: Mutex::new(None),
            srq,
            anchor: id.clone(),
            pd,
            buf_bytes,
            max_buffers,
            global_limit,
            state: Mutex::new(PoolState::default()),
        })
    }

    pub(crate) fn srq(&self) -> &Arc<Srq> {
        &self.srq
    }

    pub(crate) fn pd(&self) -> &Arc<Pd> {
        &self.pd
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState<Arc<RegisteredBuf>>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Raises the sum of credit limits by `n` and posts buffers (registering
    /// chunks) until the pool covers it. Fails, changing nothing that
    /// matters, if the SRQ or the registration cap is full.
    pub(crate) fn reserve(&self, n: usize) -> Result<(), Error> {
        let mut st = self.lock();
        let chunks = st
            .chunks_short(n, self.max_buffers)
            .map_err(|max| Error::ResourceLimit(ResourceError::SharedReceiveQueueFull { max }))?;
        for _ in 0..chunks {
            let chunk = RegisteredBuf::new(
                &self.pd,
                CHUNK_BUFFERS * self.buf_bytes,
                Access::Local,
                self.global_limit,
            )?;
            st.add_chunk(Arc::new(chunk));
        }
        st.reserve(n);
        self.post(&mut st)
    }

    /// Lowers the sum of credit limits by `n` (a connection closed, or its
    /// credits were revoked), and starts a drain if that left more buffers
    /// posted than the connections' credits and the slack need: at once for
    /// [`DRAIN_MIN`] or more, after [`DRAIN_SETTLE`] for fewer.
    pub(crate) fn unreserve(self: &Arc<Self>, n: usize) {
        let mut st = self.lock();
        st.reserved = st.reserved.saturating_sub(n);
        let surplus = drain_size(&st);
        if st.draining || st.drain_off || surplus == 0 {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        st.draining = true;
        drop(st);
        let weak = Arc::downgrade(self);
        rt.spawn(async move {
            if surplus < DRAIN_MIN {
                // Closes that arrive meanwhile find `draining` set: this
                // run takes back their buffers too.
                tokio::time::sleep(DRAIN_SETTLE).await;
            }
            loop {
                let Some(p) = weak.upgrade() else { break };
                match p.drain_batch().await {
                    Ok(true) => {}
                    Ok(false) => break,
                    Err(e) => {
                        tracing::warn!(
                            "shared receive pool: taking back posted buffers failed ({e}); \
                             they stay posted until traffic consumes them"
                        );
                        let mut st = p.lock();
                        st.draining = false;
                        st.compact_left = None;
                        st.drain_off = true;
                        break;
                    }
                }
            }
        });
    }

    /// One round of the drain (wire protocol §4.7, "Shrinking"): posts as
    /// many zero-length SENDs on the pool's loopback QP as there are
    /// drainable buffers (at most [`DRAIN_BATCH`]), each consuming one
    /// posted receive, and makes the consumed buffers idle (chunks whose
    /// buffers are all idle are deregistered). `Ok(false)`: nothing left
    /// to drain (`draining` cleared under the same lock).
    async fn drain_batch(&self) -> Result<bool, Error> {
        let k = {
            let mut st = self.lock();
            // Started at DRAIN_MIN; once running, down to what it may take.
            let mut k = drain_size(&st).min(DRAIN_BATCH);
            if k == 0 {
                // All that may be taken back is: pack what stays posted
                // into fewer chunks, one cycle through the SRQ at most.
                k = st.compact(DRAIN_BATCH);
                if k > 0 {
                    if let Err(e) = self.post(&mut st) {
                        // Counted as posted (some may not be): their chunks
                        // stay registered, which is the safe side.
                        st.post.clear();
                        return Err(e);
                    }
                }
            }
            if k == 0 {
                st.draining = false;
                st.compact_left = None;
                return Ok(false);
            }
            st.drain_start(k);
            k
        };
        // Only one drain task runs per pool (`draining`): the QP is taken
        // out for the round and put back after.
        let kept = self.drain.lock().unwrap_or_else(|p| p.into_inner()).take();
        let qp = match kept {
            Some(qp) => qp,
            None => {
                let ip = self
                    .anchor
                    .local_addr()
                    .map(|a| a.ip())
                    .ok_or(Error::NoDevice(NoDeviceReason::NoPoolAddress));
                match ip.and_then(|ip| {
                    LoopQp::new(&self.anchor, &self.pd, &self.srq, ip, DRAIN_BATCH as u32)
                }) {
                    Ok(qp) => qp,
                    Err(e) => {
                        self.lock().drain_undo(k);
                        return Err(e);
                    }
                }
            }
        };
        let (consumed, r) = self.drain_round(&qp, k).await;
        if let Err(e) = r {
            // The QP is in the error state: no more receive is consumed.
            // What it did not consume is still posted.
            self.lock().drain_undo(k - consumed);
            return Err(e);
        }
        *self.drain.lock().unwrap_or_else(|p| p.into_inner()) = Some(qp);
        Ok(true)
    }

    /// Posts `k` SENDs on `qp` and waits for the receives they consume:
    /// (receives consumed, outcome). On a failure the QP is moved to the
    /// error state and its completions drained before returning.
    async fn drain_round(&self, qp: &LoopQp, k: usize) -> (usize, Result<(), Error>) {
        let mut consumed = 0;
        let mut sent = 0;
        let mut failure = qp
            .post_empty_sends(k, WR_DRAIN << 56)
            .err()
            .map(|(posted, e)| {
                sent = k - posted; // never posted: no completion will come
                e
            });
        let mut wcs = Vec::with_capacity(32);
        let start = std::time::Instant::now();
        let mut quiet_since: Option<std::time::Instant> = None;
        loop {
            wcs.clear();
            let n = match qp.cq().poll(&mut wcs, 32) {
                Ok(n) => n,
                Err(e) => {
                    failure.get_or_insert(e);
                    0
                }
            };
            for wc in &wcs {
                if wc.wr_id >> 56 == WR_SRQ {
                    // Completed or flushed, this posted receive is gone
                    // from the SRQ.
                    consumed += 1;
                    self.lock().drained(wc.wr_id as u32);
                    crate::stats::GLOBAL
                        .receive_buffers_drained
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                } else {
                    sent += 1;
                    if wc.status != 0 && failure.is_none() {
                        failure = Some(Error::Completion {
                            status: wc.status,
                            status_str: Cq::status_str(wc.status),
                            what: "send (shared receive pool drain)",
                        });
                    }
                }
            }
            if failure.is_none() && consumed == k && sent == k {
                return (consumed, Ok(()));
            }
            if failure.is_none() && start.elapsed() > std::time::Duration::from_secs(5) {
                failure = Some(Error::Timeout {
                    stage: "shared receive pool drain",
                });
            }
            if failure.is_some() {
                if quiet_since.is_none() {
                    let _ = qp.to_error();
                    quiet_since = Some(std::time::Instant::now());
                }
                // Flushed completions come promptly: 200 ms without one
                // more ends the wait (a receive consumed but never reported
                // would be counted as still posted: one buffer of slack).
                if n > 0 {
                    quiet_since = Some(std::time::Instant::now());
                } else if quiet_since
                    .is_some_and(|t| t.elapsed() > std::time::Duration::from_millis(200))
                {
                    if let Some(e) = failure {
                        return (consumed, Err(e));
                    }
                }
            }
            if n == 0 {
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
        }
    }

    /// The chunk holding buffer `b` and the buffer's offset in it, for a
    /// buffer a receive completion just handed to a connection.
    #[inline]
    pub(super) fn held(&self, b: u32) -> Option<(Arc<RegisteredBuf>, usize)> {
        let mut st = self.lock();
        if !st.hold(b) {
            return None;
        }
        let k = b as usize / CHUNK_BUFFERS;
        let chunk = st.chunks[k].as_ref()?.clone();
        Some((chunk, (b as usize % CHUNK_BUFFERS) * self.buf_bytes))
    }

    /// Takes back buffers a connection is done with ([`PoolState::give_back`]).
    pub(crate) fn give_back(&self, bufs: &[u32]) -> Result<(), Error> {
        if bufs.is_empty() {
            return Ok(());
        }
        let mut st = self.lock();
        st.give_back(bufs);
        self.post(&mut st)
    }

    /// Posts the buffers in `st.post` to the SRQ, one call.
    fn post(&self, st: &mut PoolState<Arc<RegisteredBuf>>) -> Result<(), Error> {
        let mut list: [(u64, u64, u32, u32); crate::verbs::POST_BATCH] =
            [(0, 0, 0, 0); crate::verbs::POST_BATCH];
        for batch in st.post.chunks(crate::verbs::POST_BATCH) {
            for (d, &b) in list.iter_mut().zip(batch) {
                let k = b as usize / CHUNK_BUFFERS;
                let chunk = st.chunks[k]
                    .as_ref()
                    .expect("a posted buffer's chunk is registered");
                let off = (b as usize % CHUNK_BUFFERS) * self.buf_bytes;
                *d = (
                    (WR_SRQ << 56) | u64::from(b),
                    chunk.addr() + off as u64,
                    self.buf_bytes as u32,
                    chunk.lkey(),
                );
            }
            // PoolState::give_back lets a chunk go only when all of its
            // buffers are idle, and the pool drops the SRQ before its chunks.
            // SAFETY: each range is one buffer of a chunk registered on the
            // SRQ's PD, registered while the buffer is posted or held (above);
            // no connection reads a buffer before its receive completes.
            unsafe { self.srq.post(&list[..batch.len()]) }?;
        }
        st.post.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool() -> PoolState<()> {
        PoolState::default()
    }

    /// reserve(n) as RecvPool does it, without verbs; returns the posts.
    fn reserve(p: &mut PoolState<()>, n: usize, max: usize) -> Result<Vec<u32>, usize> {
        for _ in 0..p.chunks_short(n, max)? {
            p.add_chunk(());
        }
        p.reserve(n);
        Ok(std::mem::take(&mut p.post))
    }

    fn give_back(p: &mut PoolState<()>, bufs: &[u32]) -> Vec<u32> {
        p.give_back(bufs);
        std::mem::take(&mut p.post)
    }

    #[test]
    fn reservations_are_posted_with_the_slack_in_whole_chunks() {
        let mut p = pool();
        let posted = reserve(&mut p, 4, 1 << 14).unwrap();
        assert_eq!(
            posted.len(),
            4 + POOL_SLACK,
            "the first connection's 4 and the slack"
        );
        assert_eq!(
            p.registered(),
            2 * CHUNK_BUFFERS,
            "20 buffers take 2 chunks"
        );
        // 3 more connections fit in the idle buffers: no registration.
        for _ in 0..3 {
            assert_eq!(reserve(&mut p, 4, 1 << 14).unwrap().len(), 4);
        }
        assert_eq!((p.active, p.registered()), (32, 32));
        // The next one needs a chunk.
        assert_eq!(reserve(&mut p, 4, 1 << 14).unwrap().len(), 4);
        assert_eq!(p.registered(), 48);
        let mut all: Vec<u32> = Vec::new();
        let mut q = pool();
        for _ in 0..5 {
            all.extend(reserve(&mut q, 4, 1 << 14).unwrap());
        }
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 36, "no buffer is posted twice");
    }

    #[test]
    fn the_cap_refuses_a_reservation_and_changes_nothing() {
        let mut p = pool();
        reserve(&mut p, 4, 32).unwrap();
        reserve(&mut p, 12, 32).unwrap(); // 32 = 2 chunks, all active
        assert_eq!(reserve(&mut p, 4, 32), Err(32));
        assert_eq!((p.reserved, p.active, p.registered()), (16, 32, 32));
    }

    #[test]
    fn buffers_are_reposted_at_the_target_and_let_go_above_it() {
        let mut p = pool();
        let posted = reserve(&mut p, 4, 1 << 14).unwrap();
        // A message arrives in each buffer and is consumed: all reposted.
        assert_eq!(give_back(&mut p, &posted), posted);
        // The connection closes holding 2 buffers: its credits leave the
        // target (16), the pool holds 20 → 2 go idle, none reposted.
        p.reserved -= 4;
        assert!(give_back(&mut p, &posted[..2]).is_empty());
        assert_eq!((p.active, p.idle.len()), (18, 14));
        // Traffic from other connections brings the rest back over time: the
        // pool shrinks to its target and lets a chunk go once it is all idle.
        assert!(give_back(&mut p, &posted[2..4]).is_empty());
        assert_eq!(p.active, 16);
        assert_eq!(
            p.registered(),
            2 * CHUNK_BUFFERS,
            "chunk 1 still has posted buffers"
        );
        let mut q = pool();
        let posted = reserve(&mut q, 4, 1 << 14).unwrap();
        q.reserved = 0; // every connection gone
                        // Chunk 0's 4 posted buffers come back first: all of it is then idle.
        let order: Vec<u32> = posted[16..].iter().chain(&posted[..16]).copied().collect();
        assert!(order[..4].iter().all(|&b| (b as usize) < CHUNK_BUFFERS));
        let reposted = give_back(&mut q, &order);
        assert_eq!(reposted.len(), POOL_SLACK, "the slack stays posted");
        assert_eq!(
            q.registered(),
            CHUNK_BUFFERS,
            "the chunk with only idle buffers is gone"
        );
        assert!(q
            .idle
            .iter()
            .all(|&b| (b as usize) < CHUNK_BUFFERS * q.chunks.len()));
        assert!(q
            .idle
            .iter()
            .all(|&b| q.chunks[b as usize / CHUNK_BUFFERS].is_some()));
    }

    #[test]
    fn a_foreign_buffer_is_ignored() {
        let mut p = pool();
        reserve(&mut p, 4, 1 << 14).unwrap();
        assert!(give_back(&mut p, &[999_999]).is_empty());
        assert_eq!(p.active, 20);
    }

    #[test]
    fn a_drain_takes_back_only_what_no_credit_stands_for() {
        let mut p = pool();
        for _ in 0..10 {
            reserve(&mut p, 4, 1 << 14).unwrap();
        }
        assert_eq!((p.active, p.registered()), (56, 64));
        assert_eq!(
            p.drainable(),
            0,
            "every posted buffer backs a credit or the slack"
        );
        // One connection holds a buffer (its receive completed).
        let b = (0..64u32)
            .find(|&b| !p.idle.contains(&b))
            .expect("a posted buffer");
        assert!(p.hold(b));
        assert!(!p.hold(b), "a buffer is held once");
        assert!(!p.hold(999_999), "not one of ours");
        // Nine connections close: 36 credits leave the target.
        p.reserved -= 36;
        // Posted 55; the 4 credits (one of them held) need 3, the slack 16.
        assert_eq!(p.drainable(), 36);
        assert_eq!(
            drain_size(&p),
            20,
            "one more slack is left for closing QPs' buffers"
        );
        p.drain_start(20);
        assert_eq!(p.active, 36);
        // While the drain runs, the held buffer comes back: above the
        // target, it goes idle.
        give_back(&mut p, &[b]);
        assert_eq!((p.active, p.held), (35, 0));
        // The drain consumed 20 posted buffers: idle now.
        let posted: Vec<u32> = (0..64u32)
            .filter(|&x| !p.idle.contains(&x) && x != b)
            .collect();
        for &x in &posted[..20] {
            p.drained(x);
        }
        assert_eq!(p.idle.len() + p.active, p.registered());
        assert_eq!(
            p.drainable(),
            35 - 20,
            "what is left is 20 above the target"
        );
        assert_eq!(
            drain_size(&p),
            0,
            "within the second slack: nothing more to drain"
        );
        // If the drain had stopped after consuming 15 of 20, the other 5
        // would still be posted.
        let mut q = pool();
        for _ in 0..10 {
            reserve(&mut q, 4, 1 << 14).unwrap();
        }
        q.reserved -= 36;
        q.drain_start(20);
        q.drain_undo(5);
        assert_eq!(q.active, 56 - 15);
    }

    /// The SRQ as the NIC sees it: receives handed out in posting order.
    struct Fifo(std::collections::VecDeque<u32>);

    impl Fifo {
        fn post(&mut self, p: &mut PoolState<()>) {
            self.0.extend(p.post.drain(..));
        }
        /// A drain round of `k` SENDs: the `k` oldest receives.
        fn drain(&mut self, p: &mut PoolState<()>, k: usize) {
            p.drain_start(k);
            for _ in 0..k {
                let b = self.0.pop_front().expect("a posted receive");
                p.drained(b);
            }
        }
    }

    #[test]
    fn after_a_drain_what_stays_posted_is_packed_into_few_chunks() {
        let mut p = pool();
        let mut srq = Fifo(Default::default());
        for _ in 0..96 {
            for _ in 0..p.chunks_short(4, 1 << 14).unwrap() {
                p.add_chunk(());
            }
            p.reserve(4);
            srq.post(&mut p);
        }
        assert_eq!(p.chunk_count(), 25);
        // Traffic: every 7th posted receive completes and is reposted, so
        // the newest receives are spread over all the chunks.
        let mut moved = Vec::new();
        let all: Vec<u32> = srq.0.iter().copied().collect();
        for (i, &b) in all.iter().enumerate() {
            if i % 7 == 3 {
                moved.push(b);
            }
        }
        srq.0.retain(|b| !moved.contains(b));
        for &b in &moved {
            assert!(p.hold(b));
        }
        p.give_back(&moved);
        assert_eq!(p.post.len(), moved.len(), "at the target: reposted");
        srq.post(&mut p);
        // 95 connections close.
        p.reserved -= 95 * 4;
        while drain_size(&p) > 0 {
            let k = drain_size(&p).min(DRAIN_BATCH);
            srq.drain(&mut p, k);
        }
        let posted = p.active;
        assert!(
            p.fragmented(),
            "the reposted receives keep {} chunks for {posted} buffers",
            p.chunk_count()
        );
        let mut rounds = 0;
        loop {
            let k = p.compact(DRAIN_BATCH);
            if k == 0 {
                break;
            }
            srq.post(&mut p);
            srq.drain(&mut p, k);
            rounds += 1;
            assert!(rounds < 10, "one cycle through the SRQ at most");
        }
        assert_eq!(p.active, posted, "compaction keeps as many posted");
        assert_eq!(srq.0.len(), posted);
        assert!(
            p.chunk_count() <= posted.div_ceil(CHUNK_BUFFERS) + 1,
            "{} chunks for {posted} posted buffers",
            p.chunk_count()
        );
        // Every posted buffer is in a registered chunk, none also idle.
        for &b in &srq.0 {
            assert!(p.ours(b) && !p.idle.contains(&b));
        }
        assert_eq!(p.idle.len() + p.active, p.registered());
        // A second drain run starts a new cycle.
        p.compact_left = None;
        assert_eq!(p.compact(DRAIN_BATCH), 0, "not fragmented: nothing");
    }
}
