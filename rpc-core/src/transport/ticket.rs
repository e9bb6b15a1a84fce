//! RDMA tickets: how a TLS server admits RDMA connections only from peers
//! that authenticated through TLS (`docs/wire-protocol.md` §4, `docs/wire-protocol-rdma.md` §2.4).
//!
//! A client with `tls_config` first connects over TLS (tonic's), then calls
//! `/rdma_grpc.RdmaTicket/Issue` on that connection. The server answers with
//! a random 96-bit ticket, valid once and for [`TICKET_LIFETIME`], and keeps
//! with it what TLS told about the peer (its certificates). The client puts
//! the ticket in its RDMA connect request; the listener's gate refuses any
//! request without a live ticket before a queue pair or any memory is set up
//! for it, and the accepted connection's calls carry the TLS peer's
//! certificates (`request.peer_certs()`), as they do over TCP.
//!
//! This module owns the ticket table, the service that issues tickets, and
//! the client's call that fetches one.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tonic::body::Body;

use super::control;
use crate::info::{PeerTls, TlsPeer};

/// The service's full name.
pub(crate) const SERVICE: &str = "rdma_grpc.RdmaTicket";
/// The method's path.
pub(crate) const PATH: &str = "/rdma_grpc.RdmaTicket/Issue";
/// Bytes in a ticket (they fit beside the 44-byte hello in rdma_cm's 56
/// bytes of connect private data).
pub(crate) const TICKET_LEN: usize = 12;
/// How long an issued ticket can be presented.
pub(crate) const TICKET_LIFETIME: Duration = Duration::from_secs(10);
/// Live tickets kept at most (each one is a client between its TLS call
/// and its RDMA connect request): beyond, new ones are refused.
const MAX_LIVE: usize = 4096;

/// A ticket.
pub(crate) type Ticket = [u8; TICKET_LEN];

struct Issued {
    expires: Instant,
    peer: Option<TlsPeer>,
}

/// The server's tickets: issued (not yet presented) and claimed (presented
/// by a connect request that the gate let through, until its accept).
#[derive(Default)]
pub(crate) struct TicketStore {
    state: Mutex<Tables>,
}

#[derive(Default)]
struct Tables {
    issued: HashMap<Ticket, Issued>,
    claimed: HashMap<Ticket, Issued>,
}

impl Tables {
    fn expire(&mut self, now: Instant) {
        self.issued.retain(|_, i| i.expires > now);
        // A claimed ticket whose connection never completed setup.
        self.claimed
            .retain(|_, i| i.expires + TICKET_LIFETIME > now);
    }
}

/// Why a ticket could not be issued.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum IssueError {
    /// Too many tickets live at once.
    #[error("{MAX_LIVE} RDMA tickets are live; try again shortly")]
    Busy,
    /// The OS's random source failed.
    #[error("no randomness for an RDMA ticket: {0}")]
    Random(String),
}

impl TicketStore {
    /// A new ticket for `peer`, valid once for [`TICKET_LIFETIME`].
    pub(crate) fn issue(&self, peer: Option<TlsPeer>, now: Instant) -> Result<Ticket, IssueError> {
        let mut t = [0u8; TICKET_LEN];
        // All zeros is never issued: on IB/RoCE a ticket flag whose bytes
        // are missing reads as zeros (rdma_cm pads the private data).
        while t == [0u8; TICKET_LEN] {
            random(&mut t)?;
        }
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.expire(now);
        if st.issued.len() + st.claimed.len() >= MAX_LIVE {
            return Err(IssueError::Busy);
        }
        st.issued.insert(
            t,
            Issued {
                expires: now + TICKET_LIFETIME,
                peer,
            },
        );
        Ok(t)
    }

    /// The listener's gate: lets a connect request through if it presents a
    /// live ticket, which is used up by it.
    pub(crate) fn claim(&self, ticket: Option<&Ticket>, now: Instant) -> Result<(), &'static str> {
        let Some(t) = ticket else {
            return Err("unauthenticated: this server admits RDMA only with a ticket got over TLS");
        };
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.expire(now);
        match st.issued.remove(t) {
            Some(i) => {
                st.claimed.insert(*t, i);
                Ok(())
            }
            None => Err("unauthenticated: unknown, used or expired RDMA ticket"),
        }
    }

    /// The TLS identity of an accepted connection's claimed ticket (`None`
    /// if the ticket was never claimed: the connection must be dropped).
    pub(crate) fn take(&self, ticket: &Ticket) -> Option<Option<TlsPeer>> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.claimed.remove(ticket).map(|i| i.peer)
    }
}

fn random(out: &mut [u8]) -> Result<(), IssueError> {
    #[cfg(feature = "tls")]
    {
        getrandom::fill(out).map_err(|e| IssueError::Random(e.to_string()))
    }
    #[cfg(not(feature = "tls"))]
    {
        let _ = out;
        Err(IssueError::Random("built without the `tls` feature".into()))
    }
}

/// Serves `Issue` on a TLS server's TCP side.
#[derive(Clone)]
pub(crate) struct TicketService {
    pub(crate) store: Arc<TicketStore>,
}

impl tonic::server::NamedService for TicketService {
    const NAME: &'static str = SERVICE;
}

impl tower::Service<http::Request<Body>> for TicketService {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<http::Response<Body>, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        if req.uri().path() != PATH {
            return std::future::ready(Ok(control::no_method(SERVICE, req.uri().path())));
        }
        #[cfg(feature = "tls")]
        let peer = req.extensions().get::<PeerTls>().cloned();
        #[cfg(not(feature = "tls"))]
        let peer: Option<PeerTls> = None;
        // Only a call that came over TLS gets a ticket.
        let Some(peer) = peer else {
            return std::future::ready(Ok(tonic::Status::permission_denied(
                "RDMA tickets are issued over TLS only",
            )
            .into_http()));
        };
        let ticket = match self
            .store
            .issue(Some(TlsPeer(Arc::new(peer))), Instant::now())
        {
            Ok(t) => t,
            Err(e) => {
                return std::future::ready(Ok(
                    tonic::Status::resource_exhausted(e.to_string()).into_http()
                ))
            }
        };
        // IssueResponse { bytes ticket = 1; }
        let mut msg = [0u8; 2 + TICKET_LEN];
        msg[0] = 0x0a;
        msg[1] = TICKET_LEN as u8;
        msg[2..].copy_from_slice(&ticket);
        std::future::ready(Ok(control::reply(&msg)))
    }
}

/// Parses an `Issue` response body: the ticket.
pub(crate) fn parse_response(body: &[u8]) -> Result<Ticket, String> {
    match control::message(body) {
        Some([0x0a, n, rest @ ..]) if usize::from(*n) == TICKET_LEN && rest.len() == TICKET_LEN => {
            let mut t = [0u8; TICKET_LEN];
            t.copy_from_slice(rest);
            Ok(t)
        }
        _ => Err("malformed RDMA ticket response".into()),
    }
}

/// Asks a TLS server for an RDMA ticket over `ch` (its TLS channel).
pub(crate) async fn fetch(ch: &tonic::transport::Channel) -> Result<Ticket, String> {
    let answer = control::call(ch, PATH, 64, "RDMA ticket request").await?;
    if answer.trailers_only || !answer.ok() {
        return Err(format!(
            "the server issued no RDMA ticket ({})",
            answer.status_text()
        ));
    }
    parse_response(&answer.data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ticket_admits_once_and_only_while_live() {
        let s = TicketStore::default();
        let t0 = Instant::now();
        let t = s.issue(None, t0).unwrap();
        assert!(s.claim(None, t0).is_err());
        assert!(s.claim(Some(&[0; TICKET_LEN]), t0).is_err());
        assert_eq!(s.claim(Some(&t), t0), Ok(()));
        // Used up: a replay is refused.
        assert!(s.claim(Some(&t), t0).is_err());
        assert_eq!(s.take(&t), Some(None));
        assert_eq!(s.take(&t), None);
        // Expired.
        let t = s.issue(None, t0).unwrap();
        assert!(s.claim(Some(&t), t0 + TICKET_LIFETIME).is_err());
    }

    #[test]
    fn tickets_are_bounded_and_random() {
        let s = TicketStore::default();
        let t0 = Instant::now();
        let mut seen = std::collections::HashSet::new();
        for _ in 0..MAX_LIVE {
            assert!(seen.insert(s.issue(None, t0).unwrap()));
        }
        assert_eq!(s.issue(None, t0), Err(IssueError::Busy));
        // Expired ones make room.
        assert!(s.issue(None, t0 + TICKET_LIFETIME * 3).is_ok());
    }

    #[test]
    fn responses_parse_and_garbage_is_refused() {
        let mut body = vec![0, 0, 0, 0, 14, 0x0a, 12];
        body.extend_from_slice(&[7; 12]);
        assert_eq!(parse_response(&body), Ok([7; 12]));
        for bad in [
            &body[..body.len() - 1],
            &[0, 0, 0, 0, 0][..],
            &[1, 0, 0, 0, 14, 0x0a, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            &[0, 0, 0, 0, 14, 0x0a, 11, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        ] {
            assert!(parse_response(bad).is_err(), "{bad:?}");
        }
    }
}
