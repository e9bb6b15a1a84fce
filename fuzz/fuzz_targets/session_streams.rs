//! A session's stream table and flow-control windows
//! (`rpc_core::__private::streams`, `docs/wire-protocol.md` §1.3, §1.4, §1.6)
//! driven by arbitrary sequences of events: calls opened by either side,
//! DATA of n bytes, bytes consumed or dropped with a call's reader, calls
//! ended every way there is, GOAWAY sent and received, the connection's end,
//! and the credit the peer grants. A small model says what each step must
//! answer, and after each step the table must agree with it:
//!
//! * a call is in the table exactly when the model has it open, with its own
//!   handle and state; a removed call never comes back; every call that
//!   entered left at most once, and entered = present + removed;
//! * ids: a client's are odd and increase; a server accepts an OPEN only with
//!   an odd id above every one before, and an id rule broken is reported;
//! * windows never go negative: DATA beyond a window is reported as the
//!   typed violation with the exact excess (and ends the run, as it ends the
//!   connection); what the peer may send, plus the credit not yet granted
//!   back, plus what was received and not consumed, is always the window
//!   granted; credit is granted as soon as half a window was consumed, and
//!   only then;
//! * after GOAWAY no call opens; while draining every valid OPEN is refused;
//!   over the limit an OPEN is refused.
#![no_main]
use libfuzzer_sys::fuzz_target;
use rpc_core::__private::streams::{
    Accepted, Data, Grants, RecvWindow, Refusal, Refused, Removal, Role, SendCredit, StreamState,
    Streams, MAX_WINDOW,
};
use rpc_core::PeerMisbehaved;
use std::collections::BTreeMap;

#[derive(Default)]
struct Call {
    remote_ended: bool,
    /// Received on the call and not consumed through its reader (what its
    /// own window still owes the peer).
    outstanding: u64,
}

struct Model {
    role: Role,
    initial: u32,
    conn_window: u32,
    max: u32,
    present: BTreeMap<u32, Call>,
    /// Calls that left the table, in the order they left.
    removed: Vec<u32>,
    /// Received and handed to a call (ended or not), not consumed or
    /// dropped yet: what the connection's window still owes the peer.
    buffered: BTreeMap<u32, u64>,
    /// Client: the highest id opened; server: the peer's last id.
    last: u32,
    goaway: bool,
    draining: bool,
    opened: u64,
    credit: i64,
}

fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([
        b.get(i).copied().unwrap_or(0),
        b.get(i + 1).copied().unwrap_or(0),
    ])
}

/// The grant a window must give when `n` bytes are consumed with
/// `unclaimed` already waiting.
fn expected_grant(w: &RecvWindow, window: u32, n: u64) -> Option<u32> {
    if n == 0 {
        return None;
    }
    let total = u64::from(w.unclaimed()) + n;
    (total >= u64::from(window / 2)).then_some(total as u32)
}

fn check_window(w: &RecvWindow, window: u32, owed: u64, what: &str) {
    assert!(w.available() >= 0, "{what}: negative window {w:?}");
    assert_eq!(
        w.available() as u64 + u64::from(w.unclaimed()) + owed,
        u64::from(window),
        "{what}: credit lost or made up: {w:?}, {owed} owed"
    );
    assert!(
        w.unclaimed() == 0 || w.unclaimed() < window / 2,
        "{what}: a grant is due and was not given: {w:?}"
    );
}

impl Model {
    fn pick(&self, a: u8) -> u32 {
        if a & 0x80 == 0 && !self.present.is_empty() {
            *self
                .present
                .keys()
                .nth(usize::from(a) % self.present.len())
                .unwrap()
        } else if a & 0x40 == 0 && !self.removed.is_empty() {
            self.removed[usize::from(a) % self.removed.len()]
        } else {
            u32::from(a & 0x3f)
        }
    }

    fn remove(&mut self, t: &mut Streams<u32>, id: u32, why: Removal) {
        let got = t.remove(id, why);
        assert!(!t.contains(id), "{id} is still there after its removal");
        if self.present.remove(&id).is_some() {
            assert_eq!(got, Some(id), "removing {id}");
            self.removed.push(id);
        } else {
            assert_eq!(got, None, "{id} removed twice or never there");
        }
    }

    fn check(&self, t: &Streams<u32>) {
        assert_eq!(t.len(), self.present.len());
        for (id, call) in &self.present {
            assert_eq!(t.get(*id), Some(id), "call {id}'s handle");
            let state = if call.remote_ended {
                StreamState::RemoteEnded
            } else {
                StreamState::Open
            };
            assert_eq!(t.state(*id), Some(state), "call {id}'s state");
            let w = t.stream_window(*id).unwrap();
            check_window(w, self.initial, call.outstanding, "call window");
        }
        // The table holds as many calls as the model, each of the model's
        // under its id: so exactly those, and none that was removed.
        let removed: u64 = Removal::ALL.iter().map(|w| t.removed(*w)).sum();
        assert_eq!(t.opened(), self.opened);
        assert_eq!(removed + t.len() as u64, t.opened());
        assert_eq!(removed, self.removed.len() as u64, "a call left twice");
        let owed: u64 = self.buffered.values().sum();
        check_window(t.connection_window(), self.conn_window, owed, "connection");
        assert_eq!(t.goaway_received(), self.goaway);
        assert_eq!(t.is_draining(), self.draining);
        match self.role {
            Role::Client => {
                assert_eq!(t.next_stream() % 2, 1);
                assert!(t.next_stream() > self.last);
            }
            Role::Server => assert_eq!(t.last_peer_stream(), self.last),
        }
        assert!((0..=MAX_WINDOW).contains(&self.credit));
    }
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 6 {
        return;
    }
    let role = if data[0] & 1 == 0 {
        Role::Client
    } else {
        Role::Server
    };
    // Small windows and limits, so that the edges are reached.
    let initial = u32::from(data[1]) * 4;
    let conn_window = u32::from(u16_at(data, 2) % 2048);
    let max = u32::from(data[4] % 8);
    let mut t: Streams<u32> = Streams::new(role, initial, conn_window, max);
    let mut m = Model {
        role,
        initial,
        conn_window,
        max,
        present: BTreeMap::new(),
        removed: Vec::new(),
        buffered: BTreeMap::new(),
        last: 0,
        goaway: false,
        draining: false,
        opened: 0,
        credit: i64::from(data[5]) << 8,
    };
    let mut send = SendCredit::new(data[5] as u32 * 256);
    for step in data[6..].chunks(4) {
        let (op, a, b, c) = (
            step[0],
            step[1 % step.len()],
            u16_at(step, 2),
            step[step.len() - 1],
        );
        match op % 16 {
            // This side opens a call (a client; a server opens none).
            // (At most 64 at once: enough for the rules, and the checks stay cheap.)
            0 if role == Role::Client && m.present.len() < 64 => {
                let expected = m.last + if m.opened == 0 { 1 } else { 2 };
                match t.open(|| (expected, ())) {
                    Ok((id, ())) => {
                        assert!(!m.goaway, "a call opened after GOAWAY");
                        assert_eq!(id, expected);
                        assert_eq!(id % 2, 1);
                        m.last = id;
                        m.opened += 1;
                        m.present.insert(id, Call::default());
                    }
                    Err(Refused::GoAway) => assert!(m.goaway),
                    Err(Refused::IdsExhausted) => panic!("ids ran out at {expected}"),
                }
            }
            // The peer opens a call.
            0 | 1 | 14 => {
                let id = (m.last + u32::from(a)).saturating_sub(8);
                let end = c & 1 == 1;
                let r = t.accept(id, end, || (id, ()));
                if role == Role::Client {
                    assert_eq!(r, Err(PeerMisbehaved::OpenToClient));
                    continue;
                }
                if id % 2 == 0 {
                    assert_eq!(r, Err(PeerMisbehaved::StreamIdEven { stream: id }));
                    continue;
                }
                if id <= m.last {
                    let last = m.last;
                    assert_eq!(
                        r,
                        Err(PeerMisbehaved::StreamIdNotIncreasing { stream: id, last })
                    );
                    continue;
                }
                m.last = id;
                let expect = if m.draining {
                    Accepted::Refused(Refusal::Draining)
                } else if m.present.len() >= m.max as usize {
                    Accepted::Refused(Refusal::TooMany {
                        open: m.present.len(),
                        limit: m.max,
                    })
                } else {
                    Accepted::Opened(())
                };
                assert_eq!(r, Ok(expect));
                if r == Ok(Accepted::Opened(())) {
                    m.opened += 1;
                    m.present.insert(
                        id,
                        Call {
                            remote_ended: end,
                            outstanding: 0,
                        },
                    );
                }
            }
            // DATA of n bytes.
            2..=4 => {
                let id = m.pick(a);
                let n = u64::from(b % 1024);
                let end = c & 1 == 1;
                let conn_before = *t.connection_window();
                let stream_before = t.stream_window(id).copied();
                let r = t.recv_data(id, n as usize, end);
                if n > conn_before.available() as u64 {
                    let excess = n - conn_before.available() as u64;
                    assert_eq!(r, Err(PeerMisbehaved::ConnectionWindowExceeded { excess }));
                    return; // a violation ends the connection
                }
                match stream_before {
                    Some(w) if n > w.available() as u64 => {
                        let excess = n - w.available() as u64;
                        assert_eq!(
                            r,
                            Err(PeerMisbehaved::StreamWindowExceeded { stream: id, excess })
                        );
                        return;
                    }
                    Some(_) => {
                        assert_eq!(r, Ok(Data::Deliver(&id)));
                        let call = m.present.get_mut(&id).unwrap();
                        call.outstanding += n;
                        call.remote_ended |= end;
                        *m.buffered.entry(id).or_default() += n;
                    }
                    None => {
                        // Dropped: the connection's credit comes back at once.
                        let grant = expected_grant(&conn_before, conn_window, n);
                        assert_eq!(r, Ok(Data::Dropped(grant)));
                    }
                }
            }
            // A call's reader consumes n of its received bytes.
            5 | 6 => {
                let Some((&id, &have)) = m
                    .buffered
                    .iter()
                    .nth(usize::from(a) % m.buffered.len().max(1))
                else {
                    continue;
                };
                let n = u64::from(b).min(have);
                let expect = Grants {
                    connection: expected_grant(t.connection_window(), conn_window, n),
                    stream: t
                        .stream_window(id)
                        .and_then(|w| expected_grant(w, initial, n)),
                };
                assert_eq!(t.consumed(id, n as usize), expect);
                *m.buffered.get_mut(&id).unwrap() -= n;
                if let Some(call) = m.present.get_mut(&id) {
                    call.outstanding -= n;
                }
            }
            // A call's reader is dropped with its bytes unread.
            7 => {
                let Some((&id, &have)) = m
                    .buffered
                    .iter()
                    .nth(usize::from(a) % m.buffered.len().max(1))
                else {
                    continue;
                };
                let expect = expected_grant(t.connection_window(), conn_window, have);
                assert_eq!(t.conn_consumed(have as usize), expect);
                m.buffered.remove(&id);
            }
            // A call ends, each way but GOAWAY and the connection's end.
            8 | 9 => {
                let id = m.pick(a);
                let why = [
                    Removal::Finished,
                    Removal::PeerFinished,
                    Removal::Reset,
                    Removal::PeerReset,
                ][usize::from(c) % 4];
                m.remove(&mut t, id, why);
            }
            // GOAWAY received.
            10 => {
                let last = m.pick(a).saturating_sub(u32::from(c % 4));
                let mut gone: Vec<u32> = t
                    .recv_goaway(last)
                    .into_iter()
                    .map(|(id, h)| {
                        assert_eq!(id, h);
                        id
                    })
                    .collect();
                gone.sort_unstable();
                let expect: Vec<u32> = match role {
                    Role::Client => m
                        .present
                        .range(last.saturating_add(1)..)
                        .map(|(id, _)| *id)
                        .collect(),
                    Role::Server => Vec::new(),
                };
                assert_eq!(gone, expect, "GOAWAY({last})");
                for id in gone {
                    assert!(!t.contains(id));
                    m.present.remove(&id);
                    m.removed.push(id);
                }
                m.goaway = true;
            }
            // GOAWAY sent (draining).
            11 => {
                let last = t.start_draining();
                match role {
                    Role::Server => assert_eq!(last, m.last),
                    Role::Client => assert_eq!(last, 0),
                }
                m.draining = true;
            }
            // The peer grants send credit, or this side takes some.
            12 => {
                let inc = u32::from(b) << (c % 24);
                let r = send.grant(u32::from(a), inc);
                if m.credit + i64::from(inc) > MAX_WINDOW {
                    assert!(r.is_err());
                } else {
                    r.unwrap();
                    m.credit += i64::from(inc);
                }
                assert_eq!(send.available(), m.credit);
            }
            13 => {
                let took = send.take(usize::from(b)) as i64;
                assert_eq!(took, m.credit.min(i64::from(b)));
                m.credit -= took;
                assert_eq!(send.available(), m.credit);
            }
            // The connection ends: every call with it.
            _ if c == 0xff => {
                let mut gone: Vec<u32> = t
                    .remove_all(Removal::ConnectionClosed)
                    .into_iter()
                    .map(|(id, h)| {
                        assert_eq!(id, h);
                        id
                    })
                    .collect();
                gone.sort_unstable();
                let expect: Vec<u32> = m.present.keys().copied().collect();
                assert_eq!(gone, expect);
                m.removed.extend(std::mem::take(&mut m.present).into_keys());
                m.check(&t);
                return;
            }
            _ => {}
        }
        m.check(&t);
    }
});
