//! RDMA: the [`Connection`] over rdma-transport, and the RDMA side of
//! [`Channel`] (connect, fallback reasons, reconnect) and of the server
//! (the rdma_cm listener beside the TCP one).

use crate::client::{Connector, Inner};
use crate::conn::{Connection, FrameReceiver, FrameSender};
use crate::endpoint::ChannelBuilder;
use crate::server::Sessions;
use crate::ticket::TicketStore;
use crate::{ConnInfo, Error, Router, TransportKind};
use bytes::Bytes;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Once};
use tokio::task::JoinSet;
use tonic::Status;

/// An established rdma-transport connection as a call-protocol [`Connection`].
pub struct RdmaConnection(pub(crate) rdma_transport::Connection);

impl RdmaConnection {
    /// Wraps an established rdma-transport connection (for tests driving a
    /// raw peer; reached through `rpc_core::__private`).
    pub fn new(c: rdma_transport::Connection) -> RdmaConnection {
        RdmaConnection(c)
    }
}

/// Sending half of an [`RdmaConnection`].
pub struct RdmaSender(rdma_transport::SendHalf);

/// Receiving half of an [`RdmaConnection`].
pub struct RdmaReceiver(rdma_transport::RecvHalf);

impl Connection for RdmaConnection {
    type Sender = RdmaSender;
    type Receiver = RdmaReceiver;
    fn split(self) -> (RdmaSender, RdmaReceiver) {
        let (s, r) = self.0.split();
        (RdmaSender(s), RdmaReceiver(r))
    }
}

fn to_io(e: rdma_transport::Error) -> io::Error {
    use rdma_transport::Error as E;
    let kind = match &e {
        E::Disconnected | E::Completion { .. } => io::ErrorKind::ConnectionReset,
        E::Closed => io::ErrorKind::NotConnected,
        E::Protocol(_) => io::ErrorKind::InvalidData,
        E::MessageTooLarge { .. } => io::ErrorKind::InvalidInput,
        E::Timeout { .. } => io::ErrorKind::TimedOut,
        // Registered memory over `global_max_registered_bytes` (memory on
        // demand could not register a region): RESOURCE_EXHAUSTED.
        E::ResourceLimit(_) => io::ErrorKind::OutOfMemory,
        _ => io::ErrorKind::Other,
    };
    io::Error::new(kind, e)
}

impl FrameSender for RdmaSender {
    fn max_frame_len(&self) -> usize {
        self.0.max_message_len()
    }
    async fn send(&mut self, frame: Bytes) -> io::Result<()> {
        self.0.send(frame).await.map_err(to_io)
    }
    async fn send_parts(&mut self, head: Bytes, body: Bytes) -> io::Result<()> {
        self.0.send_parts(head, body).await.map_err(to_io)
    }
    fn frame_granule(&self) -> usize {
        self.0.chunk_len()
    }
    /// Posts from the calling task only while the connection is quiet
    /// (`SendHalf::try_send_parts`); under load the frame goes to the
    /// session's writer, which batches what queued meanwhile.
    fn try_send(&mut self, frame: Bytes) -> Result<io::Result<()>, Bytes> {
        match self.0.try_send_parts(Bytes::new(), frame) {
            Ok(r) => Ok(r.map_err(to_io)),
            Err((_, frame)) => Err(frame),
        }
    }
    fn try_send_parts(
        &mut self,
        head: Bytes,
        body: Bytes,
    ) -> Result<io::Result<()>, (Bytes, Bytes)> {
        self.0.try_send_parts(head, body).map(|r| r.map_err(to_io))
    }
    async fn close(&mut self) {
        self.0.close().await
    }
}

impl FrameReceiver for RdmaReceiver {
    async fn recv(&mut self) -> io::Result<Option<Bytes>> {
        self.0.recv().await.map_err(to_io)
    }
    fn deliver_inline(
        self,
        mut f: crate::conn::InlineFn,
    ) -> Result<crate::conn::StopFn, (Self, crate::conn::InlineFn)> {
        let stop = self
            .0
            .deliver_inline(Box::new(move |r| f(r.map_err(to_io))));
        Ok(Box::new(move || stop.stop()))
    }
}

/// Largest call-protocol frame carried as one RDMA message (both directions).
///
/// The call layer never sends frames near this size (DATA frames are at most
/// `SessionConfig::max_data_frame`, 1 MiB by default; metadata frames are
/// bounded by `max_metadata_bytes`), so this only bounds what a misbehaving
/// peer can make the transport reassemble on one connection before the call
/// layer's windows see it. A larger message closes the connection.
pub const MAX_RDMA_FRAME: usize = 16 << 20;

/// The rdma-transport configuration of the call layer's connections.
pub(crate) fn transport_config() -> rdma_transport::Config {
    rdma_transport::Config {
        max_message_bytes: MAX_RDMA_FRAME,
        ..rdma_transport::Config::default()
    }
}

/// Why this host has no RDMA device to use: the RDMA libraries are not
/// installed (`RDMA libraries not installed (libibverbs.so.1: ...)`), or
/// there is simply no device.
fn no_device_reason() -> String {
    match rdma_transport::check_libraries() {
        Err(e) => e.to_string(),
        Ok(()) => "no RDMA device on this host".to_string(),
    }
}

/// Why RDMA could not be used, in words an operator can act on.
fn reason(addr: SocketAddr, e: &rdma_transport::Error) -> String {
    use rdma_transport::Error as E;
    match e {
        E::NoDevice(_) => "no RDMA device on this host".to_string(),
        E::LibraryUnavailable(_) => e.to_string(),
        E::AddrResolve { .. } | E::RouteResolve { .. } => {
            format!("{addr} is not reachable over RDMA ({e})")
        }
        E::Rejected { .. } | E::Unreachable { .. } => {
            format!("peer {addr} does not accept RDMA connections ({e})")
        }
        E::Timeout { stage } => format!("RDMA connection setup to {addr} timed out during {stage}"),
        other => format!("RDMA connection to {addr} failed: {other}"),
    }
}

async fn resolve(addr: &str) -> Result<SocketAddr, Error> {
    let hostport = addr
        .split("://")
        .last()
        .unwrap_or(addr)
        .trim_end_matches('/');
    let mut addrs = tokio::net::lookup_host(hostport)
        .await
        .map_err(|e| Error::InvalidAddress(format!("{addr}: {e}")))?
        .collect::<Vec<_>>();
    addrs.sort_by_key(|a| !a.is_ipv4()); // rdma_cm over RoCE v2 is most often IPv4
    addrs
        .into_iter()
        .next()
        .ok_or_else(|| Error::InvalidAddress(format!("{addr}: no address found")))
}

/// Connects a channel over RDMA; the channel reconnects over RDMA after a
/// connection loss. `tls`: the channel's TLS connection, over which each
/// connection attempt gets its ticket (`crate::ticket`).
pub(crate) async fn connect_channel(
    b: &ChannelBuilder,
    tls: Option<&Inner>,
) -> Result<Inner, Error> {
    connect_channel_at(b, None, tls).await
}

/// As [`connect_channel`], to `port` instead of the target's (an RDMA
/// listener the server announced, `docs/wire-protocol.md` §3).
pub(crate) async fn connect_channel_at(
    b: &ChannelBuilder,
    port: Option<u16>,
    tls: Option<&Inner>,
) -> Result<Inner, Error> {
    let mut addr = resolve(&b.host_port()?).await?;
    if let Some(p) = port {
        addr.set_port(p);
    }
    match rdma_transport::devices() {
        Ok(d) if d.is_empty() => return Err(Error::RdmaUnavailable(no_device_reason())),
        Err(e) => return Err(Error::RdmaUnavailable(reason(addr, &e))),
        Ok(_) => {}
    }
    let cfg = rdma_transport::Config {
        resolve_timeout: b.rdma_connect_timeout,
        connect_timeout: b.rdma_connect_timeout,
        ..b.rdma_config.clone().unwrap_or_else(transport_config)
    };
    let session_cfg = b.session.clone();
    let local = b.local_address;
    let tls = tls.and_then(|t| match t {
        Inner::Tcp(ch) => Some(ch.clone()),
        Inner::Msg(_) => None,
    });
    let connector: Connector = Arc::new(move || {
        let cfg = cfg.clone();
        let session_cfg = session_cfg.clone();
        let tls = tls.clone();
        Box::pin(async move {
            let conn = match &tls {
                Some(ch) => {
                    let ticket = crate::ticket::fetch(ch).await.map_err(|why| {
                        Status::unavailable(format!("no RDMA ticket from {addr} over TLS: {why}"))
                    })?;
                    rdma_transport::connect_with_ticket(addr, &cfg, ticket).await
                }
                None => match local {
                    Some(ip) => rdma_transport::connect_from(ip, addr, &cfg).await,
                    None => rdma_transport::connect(addr, &cfg).await,
                },
            }
            .map_err(|e| Status::unavailable(reason(addr, &e)))?;
            let info = ConnInfo::new(TransportKind::Rdma, Some(conn.peer_addr()));
            crate::session::start(RdmaConnection(conn), info, session_cfg, None).await
        })
    });
    let shared = connector()
        .await
        .map_err(|s| Error::RdmaUnavailable(s.message().to_string()))?;
    tracing::info!(%addr, "connected over RDMA");
    Ok(crate::client::msg_inner(
        shared,
        Some(connector),
        b.user_agent.clone(),
    ))
}

static NO_DEVICE_LOGGED: Once = Once::new();

/// Binds the server's RDMA listener on `addr`, if this host has an RDMA
/// device for it (else `None`, logged once). With `tickets` (a TLS server),
/// only connect requests presenting a live ticket are admitted.
pub(crate) async fn bind_listener(
    addr: SocketAddr,
    cfg: rdma_transport::Config,
    tickets: Option<Arc<TicketStore>>,
) -> Option<rdma_transport::Listener> {
    match rdma_transport::devices() {
        Ok(d) if !d.is_empty() => {}
        Ok(_) => {
            NO_DEVICE_LOGGED
                .call_once(|| tracing::info!("{}: serving gRPC over TCP only", no_device_reason()));
            return None;
        }
        Err(e) => {
            NO_DEVICE_LOGGED
                .call_once(|| tracing::info!("RDMA unavailable ({e}): serving gRPC over TCP only"));
            return None;
        }
    }
    let bound = match tickets {
        None => rdma_transport::Listener::bind(addr, cfg).await,
        Some(t) => {
            let gate: rdma_transport::AdmitGate =
                Arc::new(move |r: &rdma_transport::AdmitRequest| {
                    t.claim(r.ticket.as_ref(), std::time::Instant::now())
                        .map_err(str::to_string)
                });
            rdma_transport::Listener::bind_gated(addr, cfg, gate).await
        }
    };
    match bound {
        Ok(l) => Some(l),
        Err(e) => {
            tracing::warn!(%addr, "no RDMA listener ({e}): serving gRPC over TCP only");
            None
        }
    }
}

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
                                crate::server::track_session(&sessions, &s);
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
