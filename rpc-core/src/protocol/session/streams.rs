//! The calls of one session as a state machine: the stream table
//! (`docs/wire-protocol.md` §1.3, §1.4, §1.6), without I/O, locks or a
//! runtime.
//!
//! [`Streams`] owns what the session knows of its calls and decides what
//! happens to them; the session ([`super::Shared`]) locks it, asks, and then
//! does the I/O the answer calls for (sending frames, waking a call's queue,
//! aborting a handler). It owns:
//!
//! * the calls in flight, each with its [`StreamState`], its receive window
//!   and the session's handle of it (`T`: its queue, send window and
//!   handler; anything in tests);
//! * **one place that removes a call**, [`Streams::remove`], told why
//!   ([`Removal`]): every way a call ends goes through it, including the
//!   connection's end and a GOAWAY;
//! * stream ids (§1.3): a client's are odd and increase, and run out before
//!   they wrap; a peer's OPEN must carry an odd id above the last one it
//!   opened, or the peer broke the protocol;
//! * refusing new calls (§1.5, §1.6): after a GOAWAY was received (client),
//!   while draining (server: a GOAWAY sent) or over `max_concurrent_calls`;
//! * the receive windows (§1.4), per call and for the connection
//!   ([`RecvWindow`]): DATA beyond either is a violation, and consumed bytes
//!   earn the peer credit back.
//!
//! A call that ended is not kept: it is no longer in the table, and frames
//! for it are dropped (§1.3), its DATA's connection credit given back.

use crate::hash::FastState;
use crate::protocol::flow::RecvWindow;
use crate::PeerMisbehaved;
use std::collections::HashMap;
use tonic::Code;

/// Which end of the connection this side is: only a client opens calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Opens calls (odd ids, increasing).
    Client,
    /// Accepts the calls the peer opens.
    Server,
}

/// Where a call in the table stands.
///
/// There is no state for this side's end: a server's call ends with its
/// TRAILERS ([`Removal::Finished`]), and a client's request half-close
/// changes nothing the session decides. A call that ended is removed, not
/// kept in a closed state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamState {
    /// The peer may still send DATA on the call.
    Open,
    /// The peer ended its side (END_STREAM on OPEN or DATA). DATA it sends
    /// after that is still charged to the windows and handed to the call,
    /// which reads nothing past the end it saw first.
    RemoteEnded,
}

/// Why a call left the table ([`Streams::remove`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removal {
    /// This side ended the call normally (a server's TRAILERS).
    Finished,
    /// The peer ended the call normally (TRAILERS received).
    PeerFinished,
    /// This side abandoned the call and sent RESET (cancellation, deadline,
    /// a handler's failure).
    Reset,
    /// The peer abandoned the call (RESET received).
    PeerReset,
    /// A GOAWAY received named a last stream below the call (client).
    GoneAway,
    /// The connection ended: every call on it fails.
    ConnectionClosed,
}

impl Removal {
    /// Every reason, in the order [`Streams::removed`] counts them.
    pub const ALL: [Removal; 6] = [
        Removal::Finished,
        Removal::PeerFinished,
        Removal::Reset,
        Removal::PeerReset,
        Removal::GoneAway,
        Removal::ConnectionClosed,
    ];

    fn index(self) -> usize {
        self as usize
    }
}

/// Why this side opens no new call ([`Streams::open`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The server sent GOAWAY.
    GoAway,
    /// The next id would pass `u32::MAX`: the client reconnects (§1.3).
    IdsExhausted,
}

/// Why a peer's OPEN is answered with RESET ([`Streams::accept`]); the
/// connection stays up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// This side sent GOAWAY and takes no new calls (§1.6).
    Draining,
    /// The peer opened more calls than `max_concurrent_calls` (§1.5).
    TooMany {
        /// Calls open when the OPEN came.
        open: usize,
        /// This side's `max_concurrent_calls`.
        limit: u32,
    },
}

impl Refusal {
    /// The code of the RESET that refuses the call.
    pub fn code(&self) -> Code {
        match self {
            Refusal::Draining => Code::Unavailable,
            Refusal::TooMany { .. } => Code::ResourceExhausted,
        }
    }

    /// The message of the RESET that refuses the call.
    pub fn message(&self) -> String {
        match self {
            Refusal::Draining => "server is shutting down".to_string(),
            Refusal::TooMany { open, limit } => {
                format!("too many concurrent calls on this connection ({open}, limit {limit})")
            }
        }
    }
}

/// What became of a peer's OPEN ([`Streams::accept`]).
#[derive(Debug, PartialEq, Eq)]
pub enum Accepted<R> {
    /// The call is in the table; `R` is what the caller made beside it.
    Opened(R),
    /// The call is refused with RESET; the table did not change but for the
    /// peer's last id.
    Refused(Refusal),
}

/// Where the bytes of a DATA frame go ([`Streams::recv_data`]).
#[derive(Debug, PartialEq, Eq)]
pub enum Data<'a, T> {
    /// To the call, whose handle this is.
    Deliver(&'a T),
    /// Nowhere: the call ended (or never was). Their connection credit is
    /// given back at once: the increment of WINDOW_UPDATE(0) to send, if one
    /// is due.
    Dropped(Option<u32>),
}

/// The WINDOW_UPDATEs due after the application consumed bytes
/// ([`Streams::consumed`]): first the connection's, then the call's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Grants {
    /// The increment of WINDOW_UPDATE on stream 0, if one is due.
    pub connection: Option<u32>,
    /// The increment of WINDOW_UPDATE on the call's stream, if one is due.
    pub stream: Option<u32>,
}

#[derive(Debug)]
struct Entry<T> {
    state: StreamState,
    recv: RecvWindow,
    io: T,
}

/// The calls of one session and the rules they follow (see the module docs).
#[derive(Debug)]
pub struct Streams<T> {
    role: Role,
    map: HashMap<u32, Entry<T>, FastState>,
    /// Client: the id the next call gets.
    next_local: u32,
    /// Server: the highest id the peer opened (refused calls too).
    last_peer: u32,
    /// GOAWAY received: no new calls.
    goaway: bool,
    /// GOAWAY sent (server draining): new OPENs are refused.
    draining: bool,
    /// Connection-level DATA bytes the peer may still send (§1.4).
    conn: RecvWindow,
    /// The window each call's receive side starts with.
    initial_window: u32,
    max_concurrent: u32,
    /// Calls that entered the table.
    opened: u64,
    /// Calls that left it, by [`Removal::ALL`]'s order.
    removed: [u64; Removal::ALL.len()],
}

impl<T> Streams<T> {
    /// An empty table: each call's receive window is `initial_window`, the
    /// connection's `connection_window`; a server refuses calls beyond
    /// `max_concurrent_calls` (this side's settings, sent in HELLO).
    pub fn new(
        role: Role,
        initial_window: u32,
        connection_window: u32,
        max_concurrent_calls: u32,
    ) -> Self {
        Streams {
            role,
            map: HashMap::default(),
            next_local: 1,
            last_peer: 0,
            goaway: false,
            draining: false,
            conn: RecvWindow::new(connection_window),
            initial_window,
            max_concurrent: max_concurrent_calls,
            opened: 0,
            removed: [0; Removal::ALL.len()],
        }
    }

    /// Which end this side is.
    pub fn role(&self) -> Role {
        self.role
    }

    /// Calls in the table.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when no call is in the table.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Whether call `id` is in the table (not ended).
    pub fn contains(&self, id: u32) -> bool {
        self.map.contains_key(&id)
    }

    /// The ids of the calls in the table, in no order.
    pub fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.map.keys().copied()
    }

    /// The session's handle of call `id`.
    pub fn get(&self, id: u32) -> Option<&T> {
        self.map.get(&id).map(|e| &e.io)
    }

    /// The session's handle of call `id`, to change.
    pub fn get_mut(&mut self, id: u32) -> Option<&mut T> {
        self.map.get_mut(&id).map(|e| &mut e.io)
    }

    /// Where call `id` stands; `None` once it ended.
    pub fn state(&self, id: u32) -> Option<StreamState> {
        self.map.get(&id).map(|e| e.state)
    }

    /// Call `id`'s receive window.
    pub fn stream_window(&self, id: u32) -> Option<&RecvWindow> {
        self.map.get(&id).map(|e| &e.recv)
    }

    /// The connection's receive window.
    pub fn connection_window(&self) -> &RecvWindow {
        &self.conn
    }

    /// Server: the highest id the peer opened, 0 before its first OPEN.
    pub fn last_peer_stream(&self) -> u32 {
        self.last_peer
    }

    /// Client: the id the next call would get.
    pub fn next_stream(&self) -> u32 {
        self.next_local
    }

    /// True once a GOAWAY was received: no new call opens.
    pub fn goaway_received(&self) -> bool {
        self.goaway
    }

    /// True once this side sent GOAWAY: OPENs are refused.
    pub fn is_draining(&self) -> bool {
        self.draining
    }

    /// True when this side drains and its last call left: what a graceful
    /// shutdown waits for. Only then is the session's change worth a
    /// wake-up (a table that empties at every call of a connection serving
    /// one at a time wakes nobody).
    pub fn drained(&self) -> bool {
        self.draining && self.map.is_empty()
    }

    /// Calls that entered the table so far.
    pub fn opened(&self) -> u64 {
        self.opened
    }

    /// Calls that left the table for `why` so far.
    pub fn removed(&self, why: Removal) -> u64 {
        self.removed[why.index()]
    }

    fn insert(&mut self, id: u32, state: StreamState, io: T) {
        let entry = Entry {
            state,
            recv: RecvWindow::new(self.initial_window),
            io,
        };
        self.opened += 1;
        let old = self.map.insert(id, entry);
        debug_assert!(old.is_none(), "stream {id} entered the table twice");
    }

    /// The one place a call leaves the table, for `why`; its handle, or
    /// `None` if it had already ended.
    pub fn remove(&mut self, id: u32, why: Removal) -> Option<T> {
        let e = self.map.remove(&id)?;
        self.removed[why.index()] += 1;
        tracing::trace!(stream = id, ?why, "call ended");
        Some(e.io)
    }

    /// Removes every call (the connection ended, `why`), with their ids.
    pub fn remove_all(&mut self, why: Removal) -> Vec<(u32, T)> {
        let ids: Vec<u32> = self.map.keys().copied().collect();
        ids.into_iter()
            .filter_map(|id| self.remove(id, why).map(|io| (id, io)))
            .collect()
    }

    /// Client: opens a call with the next id (§1.3); `make` builds its
    /// handle, and something for the caller. Refused after a GOAWAY, or
    /// when the ids ran out.
    pub fn open<R>(&mut self, make: impl FnOnce() -> (T, R)) -> Result<(u32, R), Refused> {
        debug_assert_eq!(self.role, Role::Client, "only a client opens calls");
        if self.goaway {
            return Err(Refused::GoAway);
        }
        let id = self.next_local;
        self.next_local = id.checked_add(2).ok_or(Refused::IdsExhausted)?;
        let (io, r) = make();
        self.insert(id, StreamState::Open, io);
        Ok((id, r))
    }

    /// Server: the peer opened call `id` (§1.3), ending its side at once if
    /// `end_stream`; `make` builds its handle if it is accepted. An even id,
    /// an id not above the peer's last one, or an OPEN sent to a client is
    /// a violation; a call over the limit or while draining is refused.
    pub fn accept<R>(
        &mut self,
        id: u32,
        end_stream: bool,
        make: impl FnOnce() -> (T, R),
    ) -> Result<Accepted<R>, PeerMisbehaved> {
        if self.role == Role::Client {
            return Err(PeerMisbehaved::OpenToClient);
        }
        if id.is_multiple_of(2) {
            return Err(PeerMisbehaved::StreamIdEven { stream: id });
        }
        if id <= self.last_peer {
            return Err(PeerMisbehaved::StreamIdNotIncreasing {
                stream: id,
                last: self.last_peer,
            });
        }
        self.last_peer = id;
        if self.draining {
            return Ok(Accepted::Refused(Refusal::Draining));
        }
        if self.map.len() >= self.max_concurrent as usize {
            return Ok(Accepted::Refused(Refusal::TooMany {
                open: self.map.len(),
                limit: self.max_concurrent,
            }));
        }
        let (io, r) = make();
        let state = if end_stream {
            StreamState::RemoteEnded
        } else {
            StreamState::Open
        };
        self.insert(id, state, io);
        Ok(Accepted::Opened(r))
    }

    /// The peer sent `n` DATA bytes on call `id`, ending its side if
    /// `end_stream` (§1.4): charged to the connection's window, then to
    /// the call's. DATA beyond either window is a violation (the
    /// connection's checked first), and changes neither.
    pub fn recv_data(
        &mut self,
        id: u32,
        n: usize,
        end_stream: bool,
    ) -> Result<Data<'_, T>, PeerMisbehaved> {
        let mut conn = self.conn;
        conn.recv(0, n)?;
        match self.map.get_mut(&id) {
            Some(e) => {
                e.recv.recv(id, n)?;
                self.conn = conn;
                if end_stream {
                    e.state = StreamState::RemoteEnded;
                }
                Ok(Data::Deliver(&e.io))
            }
            // DATA for a finished call is dropped (§1.3); its credit returns.
            None => {
                self.conn = conn;
                Ok(Data::Dropped(self.conn.consumed(n)))
            }
        }
    }

    /// The application consumed `n` bytes of call `id`'s DATA: the
    /// WINDOW_UPDATEs due (§1.4). A call that ended earns no credit of its
    /// own; the connection's comes back all the same.
    pub fn consumed(&mut self, id: u32, n: usize) -> Grants {
        Grants {
            connection: self.conn.consumed(n),
            stream: self.map.get_mut(&id).and_then(|e| e.recv.consumed(n)),
        }
    }

    /// `n` received DATA bytes left the connection's buffers without a
    /// call's reader (dropped with their call): the increment of
    /// WINDOW_UPDATE(0) due, if any.
    pub fn conn_consumed(&mut self, n: usize) -> Option<u32> {
        self.conn.consumed(n)
    }

    /// A GOAWAY arrived naming `last_stream` (§1.6): no new calls; a
    /// client's calls above `last_stream` were never taken and are removed
    /// ([`Removal::GoneAway`]), with their ids. A server removes none.
    pub fn recv_goaway(&mut self, last_stream: u32) -> Vec<(u32, T)> {
        self.goaway = true;
        if self.role == Role::Server {
            return Vec::new();
        }
        let doomed: Vec<u32> = self.ids().filter(|id| *id > last_stream).collect();
        doomed
            .into_iter()
            .filter_map(|id| self.remove(id, Removal::GoneAway).map(|io| (id, io)))
            .collect()
    }

    /// Server: this side sends GOAWAY (§1.6): new OPENs are refused from
    /// now on. Returns the last stream to name in it, the highest id the
    /// peer opened.
    pub fn start_draining(&mut self) -> u32 {
        self.draining = true;
        self.last_peer
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client() -> Streams<&'static str> {
        Streams::new(Role::Client, 100, 1000, 10)
    }

    fn server(max: u32) -> Streams<&'static str> {
        Streams::new(Role::Server, 100, 1000, max)
    }

    fn open(t: &mut Streams<&'static str>, name: &'static str) -> u32 {
        t.open(|| (name, ())).unwrap().0
    }

    fn accept(t: &mut Streams<&'static str>, id: u32) -> Result<Accepted<()>, PeerMisbehaved> {
        t.accept(id, false, || ("call", ()))
    }

    #[test]
    fn a_client_opens_odd_increasing_ids_until_they_run_out() {
        let mut t = client();
        assert_eq!(open(&mut t, "a"), 1);
        assert_eq!(open(&mut t, "b"), 3);
        assert_eq!(open(&mut t, "c"), 5);
        assert_eq!(t.next_stream(), 7);
        assert_eq!(
            (t.get(3), t.state(3)),
            (Some(&"b"), Some(StreamState::Open))
        );
        // Near the end: u32::MAX - 2 is the last id; u32::MAX would leave no next one.
        t.next_local = u32::MAX - 2;
        assert_eq!(open(&mut t, "last"), u32::MAX - 2);
        assert_eq!(t.open(|| ("none", ())), Err(Refused::IdsExhausted));
        assert_eq!(t.open(|| ("none", ())), Err(Refused::IdsExhausted));
        assert_eq!((t.len(), t.opened()), (4, 4));
    }

    #[test]
    fn a_peers_open_must_be_odd_and_above_its_last_and_never_reach_a_client() {
        let mut s = server(10);
        assert_eq!(accept(&mut s, 3), Ok(Accepted::Opened(())));
        assert_eq!(
            accept(&mut s, 4),
            Err(PeerMisbehaved::StreamIdEven { stream: 4 })
        );
        assert_eq!(
            accept(&mut s, 3),
            Err(PeerMisbehaved::StreamIdNotIncreasing { stream: 3, last: 3 })
        );
        assert_eq!(
            accept(&mut s, 1),
            Err(PeerMisbehaved::StreamIdNotIncreasing { stream: 1, last: 3 })
        );
        // Ids may skip (a refused or never-sent call), not go back.
        assert_eq!(accept(&mut s, 9), Ok(Accepted::Opened(())));
        assert_eq!(s.last_peer_stream(), 9);
        assert_eq!(s.len(), 2);
        let mut c = client();
        assert_eq!(accept(&mut c, 1), Err(PeerMisbehaved::OpenToClient));
        assert!(c.is_empty());
    }

    #[test]
    fn a_server_refuses_calls_over_its_limit_and_while_draining() {
        let mut s = server(2);
        accept(&mut s, 1).unwrap();
        accept(&mut s, 3).unwrap();
        let too_many = Refusal::TooMany { open: 2, limit: 2 };
        assert_eq!(accept(&mut s, 5), Ok(Accepted::Refused(too_many)));
        assert_eq!(too_many.code(), Code::ResourceExhausted);
        assert_eq!(
            too_many.message(),
            "too many concurrent calls on this connection (2, limit 2)"
        );
        // A refused call still counts as the peer's last id.
        assert_eq!(s.last_peer_stream(), 5);
        assert!(!s.contains(5));
        s.remove(1, Removal::Finished);
        assert_eq!(accept(&mut s, 7), Ok(Accepted::Opened(())));
        // GOAWAY names the last id opened; later OPENs are refused, earlier calls stay.
        assert_eq!(s.start_draining(), 7);
        assert!(s.is_draining());
        assert_eq!(accept(&mut s, 9), Ok(Accepted::Refused(Refusal::Draining)));
        assert_eq!(Refusal::Draining.code(), Code::Unavailable);
        assert_eq!(Refusal::Draining.message(), "server is shutting down");
        // The id rules still hold while draining.
        assert!(accept(&mut s, 9).is_err());
        let mut ids: Vec<u32> = s.ids().collect();
        ids.sort();
        assert_eq!(ids, vec![3, 7]);
        // Drained once the last call left, and only while draining.
        s.remove(3, Removal::Finished);
        assert!(!s.drained());
        s.remove(7, Removal::PeerReset);
        assert!(s.is_empty() && s.drained());
    }

    #[test]
    fn a_table_that_empties_without_draining_is_not_drained() {
        let mut s = server(2);
        assert!(s.is_empty() && !s.drained());
        accept(&mut s, 1).unwrap();
        s.remove(1, Removal::Finished);
        assert!(s.is_empty() && !s.drained());
    }

    #[test]
    fn a_client_opens_nothing_after_goaway_and_loses_the_calls_above_its_last_stream() {
        let mut t = client();
        for name in ["a", "b", "c", "d"] {
            open(&mut t, name);
        }
        let mut gone = t.recv_goaway(3);
        gone.sort();
        assert_eq!(gone, vec![(5, "c"), (7, "d")]);
        assert!(t.goaway_received());
        assert_eq!(t.open(|| ("e", ())), Err(Refused::GoAway));
        assert_eq!((t.contains(1), t.contains(3)), (true, true));
        assert_eq!(t.removed(Removal::GoneAway), 2);
        // A server that receives GOAWAY keeps its calls.
        let mut s = server(10);
        accept(&mut s, 1).unwrap();
        assert!(s.recv_goaway(0).is_empty());
        assert!(s.contains(1) && s.goaway_received());
    }

    #[test]
    fn every_removal_path_goes_through_remove_once_and_is_counted() {
        let mut t = client();
        let ids: Vec<u32> = ["fin", "pfin", "reset", "preset", "x", "y"]
            .into_iter()
            .map(|n| open(&mut t, n))
            .collect();
        assert_eq!(t.remove(ids[0], Removal::Finished), Some("fin"));
        assert_eq!(t.remove(ids[1], Removal::PeerFinished), Some("pfin"));
        assert_eq!(t.remove(ids[2], Removal::Reset), Some("reset"));
        assert_eq!(t.remove(ids[3], Removal::PeerReset), Some("preset"));
        // A call leaves once: a second removal (e.g. RESET crossing TRAILERS) finds nothing.
        assert_eq!(t.remove(ids[3], Removal::Reset), None);
        assert_eq!(t.recv_goaway(ids[4]), vec![(ids[5], "y")]);
        assert_eq!(t.remove_all(Removal::ConnectionClosed), vec![(ids[4], "x")]);
        assert!(t.is_empty());
        for why in Removal::ALL {
            assert_eq!(t.removed(why), 1, "{why:?}");
        }
        assert_eq!(t.opened(), 6);
        // Frames for a removed call find nothing.
        assert_eq!(t.get(ids[0]), None);
        assert_eq!(t.state(ids[0]), None);
    }

    #[test]
    fn a_call_moves_from_open_to_remote_ended_and_then_out() {
        let mut s = server(10);
        s.accept(1, true, || ("ended at open", ())).unwrap();
        assert_eq!(s.state(1), Some(StreamState::RemoteEnded));
        accept(&mut s, 3).unwrap();
        assert_eq!(s.state(3), Some(StreamState::Open));
        assert_eq!(s.recv_data(3, 10, false), Ok(Data::Deliver(&"call")));
        assert_eq!(s.state(3), Some(StreamState::Open));
        assert_eq!(s.recv_data(3, 5, true), Ok(Data::Deliver(&"call")));
        assert_eq!(s.state(3), Some(StreamState::RemoteEnded));
        // DATA after the end is still charged and handed over; the state stays.
        assert_eq!(s.recv_data(3, 1, false), Ok(Data::Deliver(&"call")));
        assert_eq!(s.state(3), Some(StreamState::RemoteEnded));
        assert_eq!(s.stream_window(3).unwrap().available(), 84);
        s.remove(3, Removal::Finished);
        assert_eq!(s.state(3), None);
    }

    #[test]
    fn data_beyond_a_window_is_a_violation_and_data_for_an_ended_call_returns_its_credit() {
        let mut s = Streams::<()>::new(Role::Server, 100, 150, 10);
        s.accept(1, false, || ((), ())).unwrap();
        s.accept(3, false, || ((), ())).unwrap();
        assert_eq!(
            s.recv_data(1, 101, false),
            Err(PeerMisbehaved::StreamWindowExceeded {
                stream: 1,
                excess: 1
            })
        );
        assert_eq!(
            s.connection_window().available(),
            150,
            "a violation charges nothing"
        );
        s.recv_data(1, 100, false).unwrap();
        assert_eq!(
            s.recv_data(3, 51, false),
            Err(PeerMisbehaved::ConnectionWindowExceeded { excess: 1 })
        );
        assert_eq!(s.connection_window().available(), 50);
        // An ended call's DATA is dropped and its connection credit
        // counted as consumed: 74 (< 75) is not enough for a grant...
        s.remove(3, Removal::PeerReset);
        assert_eq!(s.recv_data(3, 30, false), Ok(Data::Dropped(None)));
        assert_eq!(s.consumed(1, 44), Grants::default());
        // ...one byte more is: both windows' halves are reached at once here.
        assert_eq!(
            s.consumed(1, 6),
            Grants {
                connection: Some(80),
                stream: Some(50)
            }
        );
        assert_eq!(s.connection_window().available(), 100);
        assert_eq!(s.stream_window(1).unwrap().available(), 50);
        // A removed call earns no credit of its own; the connection's comes
        // back: 30 of call 1's 50 unread bytes read, late DATA for it
        // dropped, the last 20 unread bytes dropped with its reader.
        s.remove(1, Removal::Reset);
        assert_eq!(s.consumed(1, 30), Grants::default());
        assert_eq!(s.connection_window().unclaimed(), 30);
        assert_eq!(s.recv_data(1, 50, false), Ok(Data::Dropped(Some(80))));
        assert_eq!(s.conn_consumed(20), None);
        // Everything received was consumed: the whole window is back or due.
        let w = s.connection_window();
        assert_eq!((w.available(), w.unclaimed()), (130, 20));
    }
}
