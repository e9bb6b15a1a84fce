//! The server's RDMA accept loop: each connection the listener accepts
//! becomes a call-protocol session of the router, carrying the peer's
//! address and, on a TLS server, the TLS identity its ticket was issued to.

use super::Router;
use crate::protocol::session::Sessions;
use crate::transport::rdma::RdmaConnection;
use crate::transport::ticket::TicketStore;
use crate::{ConnInfo, Error, TransportKind};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::task::JoinSet;

/// Serves the connections of a bound RDMA listener until `stop`. Returns
/// the address listened on.
pub(crate) fn spawn_accept(
    mut listener: rdma_transport::Listener,
    router: Router,
    sessions: Sessions,
    tickets: Option<Arc<TicketStore>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
    tasks: &mut JoinSet<Result<(), Error>>,
) -> SocketAddr {
    let local = listener.local_addr();
    tracing::info!(addr = %local, "RDMA listener up");
    tasks.spawn(async move {
        loop {
            let conn = tokio::select! {
                c = listener.accept() => c,
                _ = stop.wait_for(|s| *s) => return Ok(()),
            };
            match conn {
                Ok(conn) => {
                    let mut info = ConnInfo::new(TransportKind::Rdma, Some(conn.peer_addr()))
                        .with_local(Some(local));
                    info.one_sided = Some(crate::info::OneSided(conn.remote_memory()));
                    if let Some(t) = &tickets {
                        // The gate let it through with a ticket: its TLS identity.
                        match conn.ticket().and_then(|k| t.take(&k)) {
                            Some(peer) => info.tls = peer,
                            None => {
                                tracing::warn!(peer = %conn.peer_addr(), "RDMA connection without a claimed ticket: closed");
                                continue;
                            }
                        }
                    }
                    let router = router.clone();
                    let sessions = sessions.clone();
                    tokio::spawn(async move {
                        match router.start_session(RdmaConnection(conn), info).await {
                            Ok(s) => {
                                crate::protocol::session::track_session(&sessions, &s);
                                router.watch_age(&s);
                            }
                            Err(e) => {
                                tracing::warn!("RDMA session handshake failed: {}", e.message())
                            }
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!("RDMA accept failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    });
    local
}
