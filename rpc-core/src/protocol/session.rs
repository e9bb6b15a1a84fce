//! One multiplexed call-protocol connection (`docs/wire-protocol.md` part 1).
//!
//! A session runs two tasks per connection: a *reader* that decodes frames and
//! dispatches them to per-call queues, and a *writer* that sends the frames
//! the calls could not send themselves (see [`outbox`]: a call that ends its
//! side sends its frames from its own task while the connection is not
//! back-pressured). The reader never waits on an application: per-call queues
//! are bounded by the receive window granted to the peer (§1.4), so a slow
//! call cannot stall the others.
//!
//! What happens to the calls is decided by the stream table ([`streams`]), a
//! state machine without I/O; the methods of [`Shared`] lock it, ask it, and
//! do the I/O it calls for. What a call sends goes through [`send`]: its
//! window, the connection's, the outbox's budget, and the frames.

mod call_box;
mod opened;
mod outbox;
mod queue;
mod send;
pub(crate) mod streams;

use crate::conn::{Connection, FrameReceiver, FrameSender};
use crate::protocol::frame::{self, DecodeLimits, Frame, Hello};
use crate::protocol::window::SendWindow;
use crate::{ConnInfo, PeerMisbehaved, SessionConfig};
use bytes::Bytes;
use http::HeaderMap;
pub(crate) use opened::CallFuture;
use opened::Opened;
use outbox::Outbox;
use queue::InboundTx;
pub(crate) use queue::{CallWindow, InboundRx};
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use streams::{Accepted, Data, Refused, Removal, Role, Streams};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tonic::{Code, Status};

/// Bytes of DATA that may wait in the outgoing queue of one connection.
const OUT_QUEUE_BYTES: usize = 32 << 20;

/// What the reader hands a call.
#[derive(Debug)]
pub(crate) enum Inbound {
    Headers(HeaderMap),
    Data(Bytes),
    /// The peer half-closed (request side) after its last DATA.
    End,
    Trailers(HeaderMap),
    /// TRAILERS that hold only `grpc-status: 0` ([`ok_trailers`]).
    TrailersOk,
    Reset(Status),
}

/// The trailers [`Inbound::TrailersOk`] stands for, as a map.
pub(crate) fn ok_trailers() -> HeaderMap {
    let mut t = HeaderMap::with_capacity(1);
    t.insert(
        const { http::HeaderName::from_static("grpc-status") },
        http::HeaderValue::from_static("0"),
    );
    t
}

/// A new call the peer opened (server side).
pub(crate) struct OpenCall {
    pub(crate) stream: u32,
    /// The method path: UTF-8, starting with `/` (the OPEN frame's bytes).
    pub(crate) path: Bytes,
    pub(crate) timeout: Option<Duration>,
    pub(crate) metadata: HeaderMap,
    pub(crate) inbound: InboundRx,
    pub(crate) window: CallWindow,
}

/// Called by the reader for each OPEN; must not block. Returns the call,
/// not started: the session runs it ([`opened`]).
pub(crate) type AcceptFn = Arc<dyn Fn(Arc<Shared>, OpenCall) -> CallFuture + Send + Sync>;

/// Told of each peer that violated the call protocol, before its connection closes.
pub(crate) type MisbehavedHook = Arc<dyn Fn(&ConnInfo, &PeerMisbehaved) + Send + Sync>;

/// The server side of a session: what runs each call the peer opens.
#[derive(Clone)]
pub(crate) struct Acceptor {
    pub(crate) accept: AcceptFn,
    pub(crate) on_misbehaved: Option<MisbehavedHook>,
}

/// The status calls fail with when the peer broke the protocol: the
/// violation's code and text, and the [`PeerMisbehaved`] as `source()`.
pub(crate) fn misbehaved_status(e: &PeerMisbehaved) -> Status {
    let mut st = Status::new(e.code(), format!("peer violated the call protocol: {e}"));
    st.set_source(Arc::new(e.clone()));
    st
}

/// The session's handle of one call in the stream table.
#[derive(Debug)]
struct StreamEntry {
    inbound: InboundTx,
    window: CallWindow,
    /// Server: the handler task, aborted on RESET or connection loss.
    handler: Option<tokio::task::AbortHandle>,
}

impl StreamEntry {
    /// Ends a call that was removed from the table: its handler (server side)
    /// is cancelled, its reader sees `status`, its sender stops.
    ///
    /// The handler is cancelled first: tonic turns a CANCELLED error of a
    /// request stream into its end (`None`), so a handler woken by the reset
    /// could otherwise finish its response as if the client had half-closed.
    ///
    /// "First" means finished, not only asked to stop: a handler task that
    /// is being polled on another worker when `abort` is called finishes
    /// that poll, and could see the request stream end in it (the likely
    /// cause of `cancel::bidi_cancel_with_request_open::memory` counting a
    /// cancelled call as completed, once in 20 CI runs; not reproduced in
    /// 120 local runs under load, with or without this). So the request
    /// stream learns of the reset only once the handler task is gone, from
    /// a small task that waits for it.
    fn abort(self, status: Status) {
        self.window.close(status.clone());
        let inbound = self.inbound;
        let reset = move || {
            let _ = inbound.send(Inbound::Reset(status));
        };
        match (self.handler, tokio::runtime::Handle::try_current()) {
            (Some(h), Ok(rt)) if !h.is_finished() => {
                h.abort();
                rt.spawn(async move {
                    // Next poll of the handler's worker, as a rule; a
                    // handler stuck in a blocking call is waited for by
                    // the millisecond.
                    let mut n = 0u32;
                    while !h.is_finished() {
                        n += 1;
                        if n < 64 {
                            tokio::task::yield_now().await;
                        } else {
                            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                        }
                    }
                    reset();
                });
            }
            (h, _) => {
                if let Some(h) = h {
                    h.abort();
                }
                reset();
            }
        }
    }
}

#[derive(Debug)]
struct State {
    /// The calls, their ids, states and receive windows.
    streams: Streams<StreamEntry>,
    closed: Option<Status>,
}

/// State shared by the session's tasks and its calls.
pub(crate) struct Shared {
    pub(crate) info: ConnInfo,
    pub(crate) config: SessionConfig,
    pub(crate) peer: Hello,
    /// Largest DATA payload per frame.
    pub(crate) max_data: usize,
    /// Largest DATA payload of a body's last frame ([`last_data_len`]).
    max_last_data: usize,
    outbox: Outbox,
    out_budget: Arc<Semaphore>,
    /// Connection-level send window granted by the peer (§1.4).
    conn_window: SendWindow,
    /// Client: one permit per call the peer accepts at once.
    pub(crate) call_permits: Arc<Semaphore>,
    state: Mutex<State>,
    /// Signalled when the session closes or, while it drains, its last call
    /// leaves (`Streams::drained`): what `drain` waits for.
    changed: Notify,
    shutdown: Notify,
    shut: AtomicBool,
    /// Run when the session is gone ([`Shared::on_end`]).
    on_end: Mutex<Vec<Box<dyn FnOnce() + Send>>>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        let fs = std::mem::take(self.on_end.get_mut().unwrap_or_else(|e| e.into_inner()));
        for f in fs {
            f();
        }
    }
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

fn lock_any<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn lock(m: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn io_status(what: &str, info: &ConnInfo, e: &io::Error) -> Status {
    // A transport out of registered memory (its cap) is RESOURCE_EXHAUSTED,
    // anything else that ends a connection UNAVAILABLE.
    let code = if e.kind() == io::ErrorKind::OutOfMemory {
        tonic::Code::ResourceExhausted
    } else {
        tonic::Code::Unavailable
    };
    let st = Status::new(
        code,
        format!(
            "{what} {} connection to {}: {e}",
            info.transport,
            info.peer
                .map_or_else(|| "peer".to_string(), |p| p.to_string())
        ),
    );
    match e.kind() {
        io::ErrorKind::OutOfMemory | io::ErrorKind::InvalidData => st,
        _ => broken_pipe(st),
    }
}

/// A connection that the peer closed or lost: the status' `source()` is an
/// `io::Error` of kind `BrokenPipe`, which is what a tonic handler finds in
/// the source chain of its request stream's error when an HTTP/2 client
/// goes away (tonic's streaming example looks for exactly that).
fn broken_pipe(mut st: Status) -> Status {
    let e = io::Error::new(io::ErrorKind::BrokenPipe, st.message().to_string());
    st.set_source(Arc::new(e));
    st
}

/// Handshake (§1.1): both sides send HELLO first, then wait for the peer's.
/// A peer that answers with something else is reported to `hook`.
async fn handshake<S: FrameSender, R: FrameReceiver>(
    tx: &mut S,
    rx: &mut R,
    config: &SessionConfig,
    info: &ConnInfo,
    hook: Option<&MisbehavedHook>,
) -> Result<Hello, Status> {
    let ours = Hello {
        version: frame::PROTOCOL_VERSION,
        features: if config.max_batch_bytes > 0 {
            frame::FEATURE_BATCH
        } else {
            0
        },
        max_concurrent_calls: config.max_concurrent_calls,
        initial_window: config.initial_window,
        max_metadata_bytes: config.max_metadata_bytes,
        connection_window: config.connection_window,
    };
    let work = async {
        tx.send(frame::encode_hello(&ours))
            .await
            .map_err(|e| Status::unavailable(format!("sending HELLO: {e}")))?;
        let first = rx
            .recv()
            .await
            .map_err(|e| Status::unavailable(format!("waiting for the peer's HELLO: {e}")))?
            .ok_or_else(|| {
                Status::unavailable("peer closed the connection during the handshake")
            })?;
        let limits = DecodeLimits {
            max_metadata_bytes: config.max_metadata_bytes as usize,
        };
        let kind = first.first().copied().unwrap_or(0);
        let bad = match frame::decode(first, &limits) {
            Ok(Frame::Hello(h)) if h.version == frame::PROTOCOL_VERSION => return Ok(h),
            Ok(Frame::Hello(h)) => PeerMisbehaved::VersionMismatch {
                peer: h.version,
                ours: frame::PROTOCOL_VERSION,
            },
            Ok(_) => PeerMisbehaved::ExpectedHello { kind },
            Err(e) => PeerMisbehaved::from(e),
        };
        if let Some(hook) = hook {
            hook(info, &bad);
        }
        let mut st = Status::unavailable(format!("call-protocol handshake failed: {bad}"));
        st.set_source(Arc::new(bad));
        Err(st)
    };
    tokio::time::timeout(config.handshake_timeout, work)
        .await
        .map_err(|_| {
            Status::unavailable(format!(
                "call-protocol handshake timed out after {:?}",
                config.handshake_timeout
            ))
        })?
}

/// Largest DATA payload per frame: at most `max_data_frame` and what the
/// connection carries, and, where the transport has a preferred granule
/// (RDMA: the rendezvous chunk), such that header + payload fill whole
/// granules (a 1 MiB frame = four 256 KiB rendezvous buffers, not five).
fn max_data_len(max_frame: usize, max_data_frame: usize, granule: usize) -> usize {
    let frame_len = max_frame.min(max_data_frame.saturating_add(frame::HEADER_LEN));
    let granule = granule.max(1);
    let frame_len = if frame_len >= granule && granule > frame::HEADER_LEN {
        frame_len - frame_len % granule
    } else {
        frame_len
    };
    frame_len.saturating_sub(frame::HEADER_LEN).max(1)
}

/// Largest DATA payload of a body's last frame: up to 1/64 more than
/// `max_data` (within what the connection carries), so that a body just
/// over a frame (a 1 MiB payload behind its 5-byte prefix and its field's
/// tag) leaves as one frame, not one and a frame of a few bytes, which the
/// receiver would have to join to the first (a copy of the whole message).
fn last_data_len(max_frame: usize, max_data: usize) -> usize {
    (max_data + max_data / 64)
        .min(max_frame.saturating_sub(frame::HEADER_LEN))
        .max(max_data)
}

/// Runs the handshake and starts the session's tasks.
pub(crate) async fn start<C: Connection>(
    conn: C,
    info: ConnInfo,
    config: SessionConfig,
    acceptor: Option<Acceptor>,
) -> Result<Arc<Shared>, Status> {
    let mut info = info;
    if info.id == 0 {
        info.id = crate::info::next_conn_id();
    }
    let (mut tx, mut rx) = conn.split();
    let hook = acceptor.as_ref().and_then(|a| a.on_misbehaved.as_ref());
    let peer = match handshake(&mut tx, &mut rx, &config, &info, hook).await {
        Ok(p) => p,
        Err(e) => {
            tx.close().await;
            return Err(e);
        }
    };
    let max_data = max_data_len(
        tx.max_frame_len(),
        config.max_data_frame,
        tx.frame_granule(),
    );
    let max_last_data = last_data_len(tx.max_frame_len(), max_data);
    // Frames queued together leave as one BATCH message when both sides
    // support it (§1.7): a unary call then costs one message each way.
    let batch_max = if peer.features & frame::FEATURE_BATCH != 0 {
        config.max_batch_bytes.min(tx.max_frame_len())
    } else {
        0
    };
    let permits = peer.max_concurrent_calls.clamp(1, 1 << 20) as usize;
    let role = if acceptor.is_some() {
        Role::Server
    } else {
        Role::Client
    };
    let streams = Streams::new(
        role,
        config.initial_window,
        config.connection_window,
        config.max_concurrent_calls,
    );
    let shared = Arc::new(Shared {
        info,
        config,
        peer,
        max_data,
        max_last_data,
        outbox: Outbox::new(tx, batch_max),
        out_budget: Arc::new(Semaphore::new(OUT_QUEUE_BYTES)),
        conn_window: SendWindow::new(peer.connection_window),
        call_permits: Arc::new(Semaphore::new(permits)),
        state: Mutex::new(State {
            streams,
            closed: None,
        }),
        changed: Notify::new(),
        shutdown: Notify::new(),
        shut: AtomicBool::new(false),
        on_end: Mutex::new(Vec::new()),
    });
    tokio::spawn(writer(shared.clone()));
    // Frames dispatched from the transport's own task where it can (RDMA:
    // the connection's driver, no reader-task hop); a reader task
    // otherwise.
    match rx.deliver_inline(inline_reader(shared.clone(), acceptor.clone())) {
        Ok(stop) => {
            tokio::spawn(stop_inline_on_shutdown(shared.clone(), stop));
        }
        Err((rx, _)) => {
            tokio::spawn(reader(rx, shared.clone(), acceptor));
        }
    }
    Ok(shared)
}

/// The reader's work as a frame handler run by the transport: decode,
/// dispatch (synchronous), and on the end of the connection or a violation
/// fail the session. Returns `false` once the session ended.
fn inline_reader(shared: Arc<Shared>, acceptor: Option<Acceptor>) -> crate::conn::InlineFn {
    let limits = DecodeLimits {
        max_metadata_bytes: shared.config.max_metadata_bytes as usize,
    };
    Box::new(move |next| {
        if shared.shut.load(Ordering::Acquire) {
            shared.fail(Status::unavailable("connection closed by this side"));
            return false;
        }
        match handle_next(&shared, acceptor.as_ref(), &limits, next) {
            None => true,
            Some(status) => {
                shared.fail(status);
                false
            }
        }
    })
}

/// Inline delivery ends with the session: when it fails or is closed
/// locally, stop the transport's handler (as the reader task's end drops
/// its receiver). Idle until then: no cost per frame.
async fn stop_inline_on_shutdown(shared: Arc<Shared>, stop: crate::conn::StopFn) {
    let shutdown = shared.shutdown.notified();
    tokio::pin!(shutdown);
    shutdown.as_mut().enable();
    if !shared.shut.load(Ordering::Acquire) {
        shutdown.await;
    }
    stop();
}

/// One step of the reader: the session's status when the connection ended
/// or the peer broke the protocol, `None` to go on.
/// Decodes and dispatches one frame (not a BATCH). A call's usual end,
/// TRAILERS of only `grpc-status: 0`, is recognized from its bytes
/// without building a map.
fn dispatch_bytes(
    shared: &Arc<Shared>,
    acceptor: Option<&Acceptor>,
    limits: &DecodeLimits,
    opened: &mut Opened,
    p: Bytes,
) -> Result<(), PeerMisbehaved> {
    if let Some(stream) = frame::ok_trailers_stream(&p, limits) {
        shared.deliver(stream, Inbound::TrailersOk, true);
        return Ok(());
    }
    let f = frame::decode_as::<Bytes>(p, limits)?;
    shared.dispatch(f, acceptor, opened)
}

fn handle_next(
    shared: &Arc<Shared>,
    acceptor: Option<&Acceptor>,
    limits: &DecodeLimits,
    next: io::Result<Option<Bytes>>,
) -> Option<Status> {
    let bytes = match next {
        Ok(Some(b)) => b,
        Ok(None) => {
            return Some(broken_pipe(Status::unavailable(format!(
                "{} connection closed by the peer {}",
                shared.info.transport,
                shared.info.peer.map_or_else(String::new, |p| p.to_string())
            ))))
        }
        Err(e) => {
            if e.kind() == std::io::ErrorKind::InvalidData {
                // The transport caught the peer breaking its own protocol
                // (e.g. RDMA credits or rendezvous buffers): say so.
                tracing::warn!(peer = ?shared.info.peer, "closing connection: {e}");
            } else {
                tracing::debug!(peer = ?shared.info.peer, "connection lost: {e}");
            }
            return Some(io_status("lost the", &shared.info, &e));
        }
    };
    // A peer that ignores the metadata limit it was told in HELLO is
    // misbehaving too (§1.5): every violation closes the connection.
    let mut opened = Opened::default();
    let handled = if bytes.first() == Some(&frame::kind::BATCH) {
        match frame::decode_as::<Bytes>(bytes, limits) {
            Ok(Frame::Batch(parts)) => parts
                .into_iter()
                .try_for_each(|p| dispatch_bytes(shared, acceptor, limits, &mut opened, p)),
            Ok(f) => shared.dispatch(f, acceptor, &mut opened),
            Err(e) => Err(e.into()),
        }
    } else {
        dispatch_bytes(shared, acceptor, limits, &mut opened, bytes)
    };
    match handled {
        // The calls this message opened start now that all of it (e.g. the
        // request after its OPEN) is in their queues.
        Ok(()) => {
            opened.run(shared);
            None
        }
        Err(e) => Some(shared.misbehaved(e, acceptor)),
    }
}

/// Sends what the calls queued (see [`outbox`]) until the session ends, then
/// closes the connection.
async fn writer(shared: Arc<Shared>) {
    let on_sent = |budget: u32, r: &io::Result<()>| shared.sent(budget, r);
    shared
        .outbox
        .run_writer(|| shared.shut.load(Ordering::Acquire), on_sent)
        .await;
}

async fn reader<R: FrameReceiver>(mut rx: R, shared: Arc<Shared>, acceptor: Option<Acceptor>) {
    let limits = DecodeLimits {
        max_metadata_bytes: shared.config.max_metadata_bytes as usize,
    };
    // One shutdown waiter for the whole loop, registered before `shut` is
    // checked: no waiter list insertion and removal per message.
    let shutdown = shared.shutdown.notified();
    tokio::pin!(shutdown);
    shutdown.as_mut().enable();
    let status = loop {
        if shared.shut.load(Ordering::Acquire) {
            break Status::unavailable("connection closed by this side");
        }
        let next = tokio::select! {
            biased;
            r = rx.recv() => r,
            _ = &mut shutdown => break Status::unavailable("connection closed by this side"),
        };
        if let Some(status) = handle_next(&shared, acceptor.as_ref(), &limits, next) {
            break status;
        }
    };
    shared.fail(status);
}

impl Shared {
    /// The peer broke the protocol: say why in GOAWAY (§1.6), tell the
    /// server's hook, and return the status the connection closes with.
    fn misbehaved(&self, e: PeerMisbehaved, acceptor: Option<&Acceptor>) -> Status {
        tracing::warn!(peer = ?self.info.peer, "closing connection: {e}");
        self.send_ctrl(frame::encode_goaway(0, e.code() as u32, &e.to_string()));
        if let Some(hook) = acceptor.and_then(|a| a.on_misbehaved.as_ref()) {
            hook(&self.info, &e);
        }
        misbehaved_status(&e)
    }

    pub(crate) fn closed_status(&self) -> Status {
        lock(&self.state)
            .closed
            .clone()
            .unwrap_or_else(|| Status::unavailable("connection closed"))
    }

    /// True when no new call may start on this session.
    /// Runs `f` when the session is gone (its last reference dropped: the
    /// connection closed and every call on it ended).
    pub(crate) fn on_end(&self, f: impl FnOnce() + Send + 'static) {
        lock_any(&self.on_end).push(Box::new(f));
    }

    pub(crate) fn is_unusable(&self) -> bool {
        let s = lock(&self.state);
        s.closed.is_some() || s.streams.goaway_received()
    }

    /// Closes the session: every call fails with `status`, handlers are cancelled.
    pub(crate) fn fail(&self, status: Status) {
        let streams = {
            let mut s = lock(&self.state);
            if s.closed.is_none() {
                s.closed = Some(status.clone());
            }
            s.streams.remove_all(Removal::ConnectionClosed)
        };
        for (_, e) in streams {
            e.abort(status.clone());
        }
        self.call_permits.close();
        self.out_budget.close();
        self.conn_window.close(status.clone());
        self.shut.store(true, Ordering::Release);
        self.outbox.wake_writer();
        self.shutdown.notify_waiters();
        self.changed.notify_waiters();
    }

    /// Closes the session after the queued frames are written (client side, last handle dropped).
    pub(crate) fn close_gracefully(&self) {
        self.fail(Status::unavailable("channel closed"));
    }

    /// Client: registers a new call and queues its OPEN frame (built by `open`
    /// from the id) under the same lock, so OPENs leave in increasing id order
    /// (§1.3). Returns the id, the inbound queue and the send window.
    ///
    /// `followed`: this task sends the request's end next
    /// ([`send_ctrl_followed`](Self::send_ctrl_followed)).
    pub(crate) fn open_stream(
        &self,
        open: impl FnOnce(u32) -> Bytes,
        followed: bool,
    ) -> Result<(u32, InboundRx, CallWindow), Status> {
        let mut s = lock(&self.state);
        let (id, rx, window) = self.open_locked(&mut s)?;
        if followed {
            self.send_ctrl_followed(open(id));
        } else {
            self.send_ctrl(open(id));
        }
        Ok((id, rx, window))
    }

    /// Registers a new call (client) in the locked state.
    fn open_locked(&self, s: &mut State) -> Result<(u32, InboundRx, CallWindow), Status> {
        if let Some(st) = &s.closed {
            return Err(st.clone());
        }
        let opened = s.streams.open(|| {
            let (tx, rx, window) = queue::channel(self.peer.initial_window);
            let entry = StreamEntry {
                inbound: tx,
                window: window.clone(),
                handler: None,
            };
            (entry, (rx, window))
        });
        let (id, (rx, window)) = opened.map_err(|r| match r {
            Refused::GoAway => Status::unavailable("server is shutting down (GOAWAY received)"),
            Refused::IdsExhausted => {
                Status::unavailable("stream ids exhausted on this connection; reconnect")
            }
        })?;
        Ok((id, rx, window))
    }

    /// Whether call `id` is still open (not finished, reset or failed).
    fn has_stream(&self, id: u32) -> bool {
        lock(&self.state).streams.contains(id)
    }

    /// Server: the task running call `id`'s handler, aborted on RESET or
    /// connection loss; aborted at once if the call already ended.
    fn set_handler(&self, id: u32, handle: tokio::task::AbortHandle) {
        let mut s = lock(&self.state);
        match s.streams.get_mut(id) {
            Some(e) => e.handler = Some(handle),
            None => {
                drop(s);
                handle.abort();
            }
        }
    }

    /// Removes a call that ended normally (no RESET sent).
    pub(crate) fn finish_stream(&self, id: u32) {
        let mut s = lock(&self.state);
        if let Some(e) = s.streams.remove(id, Removal::Finished) {
            e.window.finish();
        }
        if s.streams.drained() {
            drop(s);
            self.changed.notify_waiters();
        }
    }

    /// Abandons a call: tells the peer with RESET and fails the local side with `status`.
    pub(crate) fn reset_stream(&self, id: u32, status: Status) {
        let entry = {
            let mut s = lock(&self.state);
            let e = s.streams.remove(id, Removal::Reset);
            if s.streams.drained() {
                self.changed.notify_waiters();
            }
            e
        };
        if let Some(e) = entry {
            self.send_ctrl(frame::encode_reset(
                id,
                status.code() as u32,
                status.message(),
            ));
            e.abort(status);
        }
    }

    /// A call consumed `n` DATA bytes: return credit, the connection's and
    /// the call's, when half the window is used (§1.4).
    pub(crate) fn consumed(&self, id: u32, n: usize) {
        if n == 0 {
            return;
        }
        let grants = lock(&self.state).streams.consumed(id, n);
        if let Some(inc) = grants.connection {
            self.send_ctrl(frame::encode_window_update(0, inc));
        }
        if let Some(inc) = grants.stream {
            self.send_ctrl(frame::encode_window_update(id, inc));
        }
    }

    /// Returns connection-level credit for `n` DATA bytes that left the
    /// connection's buffers (consumed, or dropped with their call).
    pub(crate) fn conn_consumed(&self, n: usize) {
        if n == 0 {
            return;
        }
        let grant = lock(&self.state).streams.conn_consumed(n);
        if let Some(inc) = grant {
            self.send_ctrl(frame::encode_window_update(0, inc));
        }
    }

    /// Server: starts sending GOAWAY and refuses new calls; returns once the calls drained.
    pub(crate) async fn drain(&self) {
        self.drain_because("server shutting down").await
    }

    /// As [`drain`](Self::drain), with `why` in the GOAWAY.
    pub(crate) async fn drain_because(&self, why: &str) {
        let last = lock(&self.state).streams.start_draining();
        self.send_ctrl(frame::encode_goaway(last, 0, why));
        loop {
            let notified = self.changed.notified();
            {
                let s = lock(&self.state);
                if s.streams.is_empty() || s.closed.is_some() {
                    break;
                }
            }
            notified.await;
        }
        self.fail(Status::unavailable("server shut down"));
    }

    /// Routes one decoded frame. An `Err` is a connection-level protocol violation.
    fn dispatch(
        self: &Arc<Self>,
        f: Frame<Bytes>,
        acceptor: Option<&Acceptor>,
        opened: &mut Opened,
    ) -> Result<(), PeerMisbehaved> {
        match f {
            Frame::Hello(_) => return Err(PeerMisbehaved::SecondHello),
            Frame::Open {
                stream,
                path,
                timeout,
                metadata,
                end_stream,
            } => {
                // The table checks the role (only a server has an acceptor).
                let accepted = lock(&self.state).streams.accept(stream, end_stream, || {
                    let (tx, rx, window) = queue::channel(self.peer.initial_window);
                    let entry = StreamEntry {
                        inbound: tx.clone(),
                        window: window.clone(),
                        handler: None,
                    };
                    (entry, (tx, rx, window))
                })?;
                let ((tx, rx, window), acceptor) = match (accepted, acceptor) {
                    (Accepted::Opened(call), Some(acceptor)) => (call, acceptor),
                    (Accepted::Opened(_), None) => return Err(PeerMisbehaved::OpenToClient),
                    (Accepted::Refused(why), _) => {
                        self.send_ctrl(frame::encode_reset(
                            stream,
                            why.code() as u32,
                            &why.message(),
                        ));
                        return Ok(());
                    }
                };
                if end_stream {
                    let _ = tx.send(Inbound::End);
                }
                let call = (acceptor.accept)(
                    self.clone(),
                    OpenCall {
                        stream,
                        path,
                        timeout,
                        metadata,
                        inbound: rx,
                        window,
                    },
                );
                opened.add(self, stream, call);
            }
            Frame::Headers { stream, metadata } => {
                self.deliver(stream, Inbound::Headers(metadata), false);
            }
            Frame::Trailers { stream, metadata } => {
                self.deliver(stream, Inbound::Trailers(metadata), true);
            }
            Frame::Data {
                stream,
                data,
                end_stream,
            } => {
                let mut s = lock(&self.state);
                match s.streams.recv_data(stream, data.len(), end_stream)? {
                    Data::Deliver(e) => {
                        let woken = e.inbound.queue_data(data, end_stream);
                        drop(s);
                        if let Some(w) = woken {
                            w.wake();
                        }
                    }
                    // DATA for a finished call is dropped (§1.3); its credit returns.
                    Data::Dropped(grant) => {
                        drop(s);
                        if let Some(inc) = grant {
                            self.send_ctrl(frame::encode_window_update(0, inc));
                        }
                    }
                }
            }
            Frame::Reset {
                stream,
                code,
                message,
            } => {
                let entry = {
                    let mut s = lock(&self.state);
                    let e = s.streams.remove(stream, Removal::PeerReset);
                    if s.streams.drained() {
                        self.changed.notify_waiters();
                    }
                    e
                };
                if let Some(e) = entry {
                    e.abort(Status::new(Code::from_i32(code as i32), message));
                }
            }
            Frame::WindowUpdate {
                stream: 0,
                increment,
            } => {
                self.conn_window.grant(0, increment)?;
            }
            Frame::WindowUpdate { stream, increment } => {
                let s = lock(&self.state);
                if let Some(e) = s.streams.get(stream) {
                    e.window.grant(stream, increment)?;
                }
            }
            Frame::GoAway {
                last_stream,
                code,
                message,
            } => {
                let doomed = lock(&self.state).streams.recv_goaway(last_stream);
                tracing::debug!(code, %message, "GOAWAY from peer");
                for (_, e) in doomed {
                    e.abort(Status::unavailable(format!("server went away: {message}")));
                }
                self.changed.notify_waiters();
            }
            // `decode` refuses a BATCH inside a BATCH; this is the same rule.
            Frame::Batch(_) => {
                return Err(PeerMisbehaved::Malformed(frame::FrameError::NestedBatch))
            }
            Frame::Unknown(k) => tracing::trace!("ignoring unknown frame type {k:#x}"),
        }
        Ok(())
    }

    fn deliver(&self, stream: u32, msg: Inbound, last: bool) {
        let mut s = lock(&self.state);
        if !last {
            // Queued under the table's lock, as DATA is (no sender cloned
            // for it); the call is woken after.
            let woken = s.streams.get(stream).and_then(|e| e.inbound.queue(msg));
            drop(s);
            if let Some(w) = woken {
                w.wake();
            }
            return;
        }
        let target = s.streams.remove(stream, Removal::PeerFinished);
        let drained = s.streams.drained();
        drop(s);
        if let Some(e) = target {
            let _ = e.inbound.send(msg);
            e.window.finish();
        }
        if drained {
            self.changed.notify_waiters();
        }
    }
}

/// Keeps the client side of a call registered; dropping it before the call
/// ended resets the call (client cancellation, §1.3).
#[derive(Debug)]
pub(crate) struct CallGuard {
    pub(crate) shared: Arc<Shared>,
    pub(crate) stream: u32,
    pub(crate) done: bool,
    pub(crate) _permit: Option<OwnedSemaphorePermit>,
    pub(crate) timer: Option<tokio::task::AbortHandle>,
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        if let Some(t) = self.timer.take() {
            t.abort();
        }
        if !self.done {
            self.shared.reset_stream(
                self.stream,
                Status::cancelled("call cancelled by the client"),
            );
        }
    }
}

/// The sessions a server serves, for its graceful shutdown.
pub(crate) type Sessions = Arc<Mutex<Vec<std::sync::Weak<Shared>>>>;

/// Remembers a live session for graceful shutdown, forgetting closed ones so
/// that a long-running server does not grow with every connection it served.
pub(crate) fn track_session(sessions: &Sessions, s: &Arc<Shared>) {
    let mut v = sessions.lock().unwrap_or_else(|e| e.into_inner());
    v.retain(|w| w.strong_count() > 0);
    v.push(Arc::downgrade(s));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::message::Encoded;
    use std::task::{Poll, Waker};

    /// A server session over an in-memory connection whose acceptor logs,
    /// per call, whether its first poll ran in place (`opened`: the no-op
    /// waker) or in a task of its own; the other end is a raw connection
    /// that has done the handshake, so a test decides exactly which frames
    /// travel in which message.
    async fn server_and_raw_client() -> (
        Arc<Shared>,
        crate::conn::mem::MemSender,
        crate::conn::mem::MemReceiver,
        Arc<Mutex<Vec<(u32, bool)>>>,
    ) {
        let log = Arc::new(Mutex::new(Vec::new()));
        let l = log.clone();
        let accept: AcceptFn = Arc::new(move |shared: Arc<Shared>, call: OpenCall| {
            let l = l.clone();
            CallFuture::new(async move {
                let in_place =
                    std::future::poll_fn(|cx| Poll::Ready(cx.waker().will_wake(Waker::noop())))
                        .await;
                l.lock().unwrap().push((call.stream, in_place));
                shared.finish_stream(call.stream);
            })
        });
        let c = SessionConfig::default();
        let (server, tx, rx) = server_with(accept, c.initial_window, c.connection_window).await;
        (server, tx, rx, log)
    }

    /// A server session whose calls run `accept`, and a raw client that
    /// has done the handshake, announcing `initial_window` for its calls.
    async fn server_with(
        accept: AcceptFn,
        initial_window: u32,
        connection_window: u32,
    ) -> (
        Arc<Shared>,
        crate::conn::mem::MemSender,
        crate::conn::mem::MemReceiver,
    ) {
        let acceptor = Acceptor {
            accept,
            on_misbehaved: None,
        };
        let (a, b) = crate::conn::mem::pair();
        let info = ConnInfo::new(crate::TransportKind::Memory, None);
        let server = start(b, info, SessionConfig::default(), Some(acceptor));
        let (mut tx, mut rx) = a.split();
        let raw = async {
            let c = SessionConfig::default();
            let hello = Hello {
                version: frame::PROTOCOL_VERSION,
                features: frame::FEATURE_BATCH,
                max_concurrent_calls: c.max_concurrent_calls,
                initial_window,
                max_metadata_bytes: c.max_metadata_bytes,
                connection_window,
            };
            tx.send(frame::encode_hello(&hello)).await.unwrap();
            rx.recv().await.unwrap().expect("the server's HELLO");
        };
        let (server, ()) = tokio::join!(server, raw);
        (server.expect("server session"), tx, rx)
    }

    /// The frames of the next message the raw client receives.
    async fn next_frames(rx: &mut crate::conn::mem::MemReceiver) -> Vec<Frame<Bytes>> {
        let lim = DecodeLimits {
            max_metadata_bytes: 1 << 16,
        };
        let msg = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("a message within 10 s")
            .unwrap()
            .expect("the connection is open");
        match frame::decode_as(msg, &lim).unwrap() {
            Frame::Batch(parts) => parts.map(|p| frame::decode_as(p, &lim).unwrap()).collect(),
            f => vec![f],
        }
    }

    /// Each call's reply: one message of 150 bytes, sent with
    /// `send_message` (its end follows in TRAILERS).
    fn replies_150() -> AcceptFn {
        Arc::new(move |shared: Arc<Shared>, call: OpenCall| {
            CallFuture::new(async move {
                let msg = Encoded {
                    head: Bytes::from(vec![7u8; 150]),
                    tail: Bytes::new(),
                };
                shared
                    .send_message(call.stream, &call.window, msg, true, false)
                    .await
                    .unwrap();
            })
        })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_message_over_the_open_window_waits_for_credit_and_loses_none() {
        // The client's calls get 100 bytes of window: the message does not
        // go at once, and the first attempt takes none of the window, so
        // the first frame carries all 100, and the rest follows the update.
        let c = SessionConfig::default();
        let (_server, mut tx, mut rx) = server_with(replies_150(), 100, c.connection_window).await;
        tx.send(frame::encode_batch(&open_and_request(1)))
            .await
            .unwrap();
        assert_eq!(next_data(&mut rx, 1).await, vec![(100, false)]);
        tx.send(frame::encode_window_update(1, 50)).await.unwrap();
        assert_eq!(next_data(&mut rx, 1).await, vec![(50, true)]);
    }

    /// The DATA frames of call `id` in the raw client's next messages, up
    /// to the first message that has some.
    async fn next_data(rx: &mut crate::conn::mem::MemReceiver, id: u32) -> Vec<(usize, bool)> {
        loop {
            let got: Vec<(usize, bool)> = next_frames(rx)
                .await
                .into_iter()
                .filter_map(|f| match f {
                    Frame::Data {
                        stream,
                        data,
                        end_stream,
                    } if stream == id => Some((data.len(), end_stream)),
                    _ => None,
                })
                .collect();
            if !got.is_empty() {
                return got;
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_message_over_the_connection_window_waits_for_credit_and_loses_none() {
        // The call's window has room, the connection's only 100 bytes:
        // the first attempt gives the call's credit back and takes none of
        // the connection's.
        let (_server, mut tx, mut rx) = server_with(replies_150(), 1000, 100).await;
        tx.send(frame::encode_batch(&open_and_request(1)))
            .await
            .unwrap();
        assert_eq!(next_data(&mut rx, 1).await, vec![(100, false)]);
        tx.send(frame::encode_window_update(0, 50)).await.unwrap();
        assert_eq!(next_data(&mut rx, 1).await, vec![(50, true)]);
        // And the call's own window kept the 50 bytes not sent first: a
        // second update of the connection's lets a second call's 150 go
        // whole, in one frame.
        tx.send(frame::encode_window_update(0, 150)).await.unwrap();
        tx.send(frame::encode_batch(&open_and_request(3)))
            .await
            .unwrap();
        assert_eq!(next_data(&mut rx, 3).await, vec![(150, true)]);
    }

    fn open_and_request(id: u32) -> [Bytes; 2] {
        [
            frame::encode_open(id, "/p.S/M", None, &HeaderMap::new(), false, 1 << 14).unwrap(),
            frame::encode_data(id, b"req", true),
        ]
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_one_call_of_a_message_runs_in_place_further_ones_in_tasks() {
        let (_server, mut tx, _rx, log) = server_and_raw_client().await;
        // One call in one message: in place.
        tx.send(frame::encode_batch(&open_and_request(1)))
            .await
            .unwrap();
        // Three calls in one message: the first in place, the others spawned.
        let three: Vec<Bytes> = [3, 5, 7].into_iter().flat_map(open_and_request).collect();
        tx.send(frame::encode_batch(&three)).await.unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while log.lock().unwrap().len() < 4 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{:?}",
                log.lock().unwrap()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let mut got = log.lock().unwrap().clone();
        got.sort();
        assert_eq!(got, vec![(1, true), (3, true), (5, false), (7, false)]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_reset_in_the_message_that_opened_it_never_starts() {
        let (_server, mut tx, _rx, log) = server_and_raw_client().await;
        let [open, _] = open_and_request(1);
        let reset = frame::encode_reset(1, Code::Cancelled as u32, "changed my mind");
        tx.send(frame::encode_batch(&[open, reset])).await.unwrap();
        // Messages are handled in order, and a message's call starts before
        // the next message is read: once call 3 ran, call 1 would have too.
        tx.send(frame::encode_batch(&open_and_request(3)))
            .await
            .unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while log.lock().unwrap().is_empty() {
            assert!(tokio::time::Instant::now() < deadline, "call 3 never ran");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(*log.lock().unwrap(), vec![(3, true)]);
    }

    /// A direct-path unary reply leaves as one message written at once
    /// (`try_send_unary_reply`): HEADERS with the handler's metadata and the
    /// content type, the reply's DATA (no END_STREAM) and the TRAILERS
    /// `grpc-status: 0`, for the call that asked, in that order. A reply
    /// larger than a BATCH takes the three frames' way and arrives the same.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_direct_unary_reply_is_one_message_of_three_frames() {
        use crate::server::generated::{Limits, ServerCall};
        let accept: AcceptFn = Arc::new(|shared: Arc<Shared>, call: OpenCall| {
            let call = ServerCall {
                shared,
                call,
                span: None,
            };
            call.unary(
                Limits::default(),
                |req: tonic::Request<String>| async move {
                    let n: usize = req.into_inner().parse().unwrap_or(0);
                    let mut r = tonic::Response::new("r".repeat(n));
                    r.metadata_mut()
                        .insert("x-reply", tonic::metadata::MetadataValue::from_static("1"));
                    Ok(r)
                },
            )
            .0
        });
        let c = SessionConfig::default();
        let (_server, mut tx, mut rx) =
            server_with(accept, c.initial_window, c.connection_window).await;
        // (call, reply length, one message): 6000 bytes do not fit a BATCH.
        for (id, n, one) in [(1u32, 20usize, true), (3, 6000, false), (5, 0, true)] {
            let req = crate::protocol::message::encode(&n.to_string(), None).unwrap();
            let open = frame::encode_open(id, "/p.S/M", None, &HeaderMap::new(), false, 1 << 14);
            let request = frame::encode_data(id, &req, true);
            tx.send(frame::encode_batch(&[open.unwrap(), request]))
                .await
                .unwrap();
            let mut got = next_frames(&mut rx).await;
            assert_eq!(got.len() == 3, one, "call {id}: {got:?}");
            while got.len() < 3 {
                got.extend(next_frames(&mut rx).await);
            }
            assert_eq!(got.len(), 3, "call {id}: {got:?}");
            match &got[0] {
                Frame::Headers {
                    stream, metadata, ..
                } => {
                    assert_eq!(*stream, id);
                    assert_eq!(metadata["x-reply"], "1");
                    assert_eq!(metadata["content-type"], "application/grpc");
                }
                f => panic!("call {id}: HEADERS first, got {f:?}"),
            }
            let reply = crate::protocol::message::encode(&"r".repeat(n), None).unwrap();
            match &got[1] {
                Frame::Data {
                    stream,
                    data,
                    end_stream: false,
                } => assert!(*stream == id && *data == reply, "call {id}: {got:?}"),
                f => panic!("call {id}: DATA second, got {f:?}"),
            }
            match &got[2] {
                Frame::Trailers { stream, metadata } => {
                    assert_eq!(*stream, id);
                    assert_eq!(metadata.len(), 1);
                    assert_eq!(metadata["grpc-status"], "0");
                }
                f => panic!("call {id}: TRAILERS third, got {f:?}"),
            }
        }
    }

    #[test]
    fn data_frames_fill_whole_granules() {
        let h = frame::HEADER_LEN;
        // Default: 1 MiB frames = four 256 KiB rendezvous buffers.
        assert_eq!(
            max_data_len(16 << 20, (1 << 20) - h, 256 << 10),
            (1 << 20) - h
        );
        // A max_data_frame of a full 1 MiB would need a fifth buffer for
        // its 6-byte header: rounded down to four.
        assert_eq!(max_data_len(16 << 20, 1 << 20, 256 << 10), (1 << 20) - h);
        assert_eq!(max_data_len(16 << 20, 3 << 20, 1 << 20), (3 << 20) - h);
        // A granule larger than the frame, none, or the transport's own
        // limit deciding.
        assert_eq!(max_data_len(16 << 20, 1000, 256 << 10), 1000);
        assert_eq!(max_data_len(16 << 20, 1000, 1), 1000);
        assert_eq!(max_data_len(700, 1000, 1), 700 - h);
        assert_eq!(max_data_len(0, 1000, 1), 1);
    }

    #[test]
    fn a_body_just_over_a_frame_leaves_as_one() {
        let h = frame::HEADER_LEN;
        let max = (1 << 20) - h;
        // A 1 MiB payload behind its prefix and tag fits the last frame.
        assert_eq!(last_data_len(16 << 20, max), max + max / 64);
        assert!(last_data_len(16 << 20, max) >= (1 << 20) + 16);
        // Never beyond what the connection carries, never below max_data.
        assert_eq!(last_data_len(max + h + 10, max), max + 10);
        assert_eq!(last_data_len(max + h, max), max);
        assert_eq!(last_data_len(0, 1), 1);
    }
}
