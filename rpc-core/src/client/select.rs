//! Which transport a channel uses: RDMA where it works, else standard gRPC
//! over HTTP/2 on TCP, saying why (typed [`FallbackReason`]s); the RDMA
//! port a server announces (iWARP, `docs/wire-protocol.md` §3); the TLS
//! ticket an RDMA connection to a TLS server presents (§4); the background
//! re-probe of a channel that fell back; and the RDMA connector a message
//! channel reconnects with.

use super::endpoint::{ChannelBuilder, Reprobe};
use super::{msg_inner, Channel, Connector, Core, Direct, Inner, Req, Resp, Svc};
use crate::error::{error_chain, BoxError};
use crate::transport::rdma::{self, RdmaConnection};
use crate::{ConnInfo, Error, FallbackReason, Transport, TransportInfo, TransportKind};
use std::sync::{Arc, Weak};

/// An `Auto` channel that fell back to TCP tries RDMA again in the background
/// (`docs/architecture.md`, "Re-probing RDMA"): after `initial`, then doubling
/// up to `max`, until it succeeds or the channel is dropped. New calls then go
/// over RDMA; calls in flight on TCP finish there.
pub(super) async fn reprobe_rdma(core: Weak<Core>, b: ChannelBuilder, r: Reprobe) {
    let mut delay = r.initial;
    let mut attempts = 0u32;
    loop {
        tokio::time::sleep(delay).await;
        let Some(core) = core.upgrade() else { return };
        attempts += 1;
        let tcp = core.current();
        match b.rdma_or_discovered(tcp.as_ref()).await {
            Ok(inner) => {
                let before = core.info();
                core.install(inner, TransportInfo::of(TransportKind::Rdma, None));
                tracing::info!(
                    addr = %b.addr,
                    attempts,
                    was = %before,
                    "RDMA re-probe succeeded: new calls go over RDMA (calls in flight on TCP finish there)"
                );
                return;
            }
            Err(e) => {
                tracing::debug!(addr = %b.addr, attempts, reason = %e.fallback_reason(), next_in = ?delay.saturating_mul(2).min(r.max), "RDMA re-probe failed; staying on TCP");
                let reason = e.fallback_reason();
                {
                    let mut a = core.active.write().unwrap_or_else(|e| e.into_inner());
                    if a.info.kind == TransportKind::Tcp {
                        a.info.fallback_reason = Some(reason);
                    }
                }
                delay = delay.saturating_mul(2).min(r.max);
            }
        }
    }
}

impl ChannelBuilder {
    /// Connects according to the transport policy (as tonic's
    /// `Endpoint::connect`): RDMA where there is RDMA, else HTTP/2 on TCP,
    /// saying why ([`Channel::transport`]).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidAddress`] for a bad target, [`Error::Tls`] for an
    /// `https://` target without [`tls_config`](Self::tls_config) (or the
    /// reverse), [`Error::Connect`] when no transport reaches the server,
    /// [`Error::RdmaUnavailable`] under [`Transport::RdmaOnly`].
    pub async fn connect(&self) -> Result<Channel, Error> {
        self.check_target()?;
        let core = Core::new(Some(self.clone()), false);
        core.ensure_connected().await?;
        Ok(self.clone().wrap(core))
    }

    /// A channel that connects on its first call (as tonic's
    /// `Endpoint::connect_lazy`): a call while the server cannot be reached
    /// fails `UNAVAILABLE`, and the next one tries again. Needs a Tokio runtime
    /// when the builder has limits (their buffer's task is spawned here).
    pub fn connect_lazy(&self) -> Channel {
        let core = Core::new(Some(self.clone()), false);
        self.clone().wrap(core)
    }

    /// A channel over HTTP/2 on the IO that `connector` returns for the
    /// endpoint's URI (as tonic's `Endpoint::connect_with_connector`, e.g. an
    /// in-process `tokio::io::duplex` pair for tests, or a Unix socket). It
    /// is tonic's channel with this endpoint's HTTP/2 options, limits and
    /// timeout; it never uses RDMA ([`Channel::transport`] says `tcp`).
    ///
    /// # Errors
    ///
    /// [`Error::Connect`] if the connector or the HTTP/2 handshake fails.
    pub async fn connect_with_connector<C>(&self, connector: C) -> Result<Channel, Error>
    where
        C: tower::Service<http::Uri> + Send + 'static,
        C::Response: hyper::rt::Read + hyper::rt::Write + Send + Unpin,
        C::Future: Send,
        BoxError: From<C::Error> + Send,
    {
        let ch = self
            .tcp_endpoint()
            .connect_with_connector(connector)
            .await
            .map_err(|e| Error::Connect {
                transport: TransportKind::Tcp,
                addr: self.addr.clone(),
                detail: error_chain(&e),
            })?;
        Ok(self.over_tcp(ch))
    }

    /// As [`connect_with_connector`](Self::connect_with_connector), connecting
    /// on the first call (as tonic's `Endpoint::connect_with_connector_lazy`).
    pub fn connect_with_connector_lazy<C>(&self, connector: C) -> Channel
    where
        C: tower::Service<http::Uri> + Send + 'static,
        C::Response: hyper::rt::Read + hyper::rt::Write + Send + Unpin,
        C::Future: Send,
        BoxError: From<C::Error> + Send,
    {
        let ch = self.tcp_endpoint().connect_with_connector_lazy(connector);
        self.over_tcp(ch)
    }

    /// A channel over an established tonic channel, with this builder's limits.
    fn over_tcp(&self, ch: tonic::transport::Channel) -> Channel {
        let core = Core::connected(Inner::Tcp(ch), TransportInfo::of(TransportKind::Tcp, None));
        self.clone().wrap(core)
    }

    /// tonic's endpoint for the TCP side, with the connect timeout.
    pub(crate) fn tcp_endpoint(&self) -> tonic::transport::Endpoint {
        self.tcp.clone().connect_timeout(self.connect_timeout)
    }

    /// The target parses, and TLS and the scheme agree.
    fn check_target(&self) -> Result<(), Error> {
        let t = self.target()?;
        if t.https && !self.tls {
            return Err(Error::Tls(format!(
                "{}: an https:// target needs tls_config(ClientTlsConfig) (and rpc-core's `tls` feature)",
                self.addr
            )));
        }
        if self.tls && !t.https {
            return Err(Error::Tls(format!(
                "{}: tls_config is set but the target is not https://; use https://host:port",
                self.addr
            )));
        }
        Ok(())
    }

    /// One endpoint of a balanced channel: lazy, and `Pending` while down.
    pub(crate) fn endpoint_service(
        self,
    ) -> (Arc<Core>, tower::util::BoxService<Req, Resp, BoxError>) {
        let core = Core::new(Some(self.clone()), true);
        let svc = self.limited(Direct::new(core.clone()));
        (core, svc)
    }

    /// `direct` behind the builder's concurrency and rate limits (tower's).
    fn limited(&self, direct: Direct) -> tower::util::BoxService<Req, Resp, BoxError> {
        let svc = tower::ServiceBuilder::new()
            .option_layer(
                self.concurrency_limit
                    .map(tower::limit::ConcurrencyLimitLayer::new),
            )
            .option_layer(
                self.rate_limit
                    .map(|(n, per)| tower::limit::RateLimitLayer::new(n, per)),
            )
            .service(direct);
        tower::util::BoxService::new(svc)
    }

    fn wrap(self, core: Arc<Core>) -> Channel {
        let direct = Direct::new(core.clone());
        if self.concurrency_limit.is_none() && self.rate_limit.is_none() {
            return Channel {
                svc: Svc::Direct(direct),
                direct_path: self.direct_path,
            };
        }
        let size = self.buffer_size;
        Channel::buffered(self.limited(direct), Arc::new(move || core.info()), size)
    }

    /// Connects with the policy: the transport, what to report, and whether
    /// to re-probe RDMA in the background (an `Auto` channel on TCP).
    pub(super) async fn connect_inner(&self) -> Result<(Inner, TransportInfo, bool), Error> {
        self.check_target()?;
        let policy = match self.transport {
            Some(t) => t,
            None => Transport::from_env()?,
        };
        if self.tls && policy != Transport::TcpOnly {
            // TLS first: RDMA is admitted only with a ticket got over it
            // (docs/wire-protocol-rdma.md §2.4).
            let tcp = self.connect_tcp().await?;
            return match self.rdma_or_discovered(Some(&tcp)).await {
                Ok(rdma) => Ok((rdma, TransportInfo::of(TransportKind::Rdma, None), false)),
                Err(e) if policy == Transport::RdmaOnly => Err(e),
                Err(e) => {
                    let reason = e.fallback_reason();
                    tracing::info!(addr = %self.addr, %reason, "RDMA unavailable, staying on TLS over TCP");
                    Ok((
                        tcp,
                        TransportInfo::of(TransportKind::Tcp, Some(reason)),
                        true,
                    ))
                }
            };
        }
        match policy {
            Transport::TcpOnly => Ok((
                self.connect_tcp().await?,
                TransportInfo::of(TransportKind::Tcp, None),
                false,
            )),
            Transport::RdmaOnly => Ok((
                self.rdma_or_discovered(None).await?,
                TransportInfo::of(TransportKind::Rdma, None),
                false,
            )),
            Transport::Auto => match rdma_channel(self, None).await {
                Ok(c) => Ok((c, TransportInfo::of(TransportKind::Rdma, None), false)),
                Err(e) => {
                    let tcp = self.connect_tcp().await?;
                    // The server may listen for RDMA on another port (iWARP, §3).
                    let e = match self.rdma_discovered(&tcp, e).await {
                        Ok(rdma) => {
                            return Ok((rdma, TransportInfo::of(TransportKind::Rdma, None), false))
                        }
                        Err(e) => e,
                    };
                    let reason = e.fallback_reason();
                    tracing::info!(addr = %self.addr, %reason, "RDMA unavailable, falling back to TCP");
                    Ok((
                        tcp,
                        TransportInfo::of(TransportKind::Tcp, Some(reason)),
                        true,
                    ))
                }
            },
        }
    }

    /// RDMA at the target's port, else at the port its TCP side announces
    /// (`docs/wire-protocol.md` §3), asked over `tcp` or a short-lived
    /// connection.
    pub(crate) async fn rdma_or_discovered(&self, tcp: Option<&Inner>) -> Result<Inner, Error> {
        let tls = tcp.filter(|_| self.tls);
        let e = match rdma_channel(self, tls).await {
            Ok(c) => return Ok(c),
            Err(e) => e,
        };
        match tcp {
            Some(tcp) => self.rdma_discovered(tcp, e).await,
            None => {
                if !has_rdma_device() {
                    return Err(e);
                }
                match self.connect_tcp().await {
                    Ok(tcp) => self.rdma_discovered(&tcp, e).await,
                    Err(_) => Err(e),
                }
            }
        }
    }

    /// After RDMA failed at the target's port with `first`: asks the server
    /// over `tcp` for its RDMA port and, if it is another one, connects there.
    /// Errors: `first`, or the failure at the announced port.
    async fn rdma_discovered(&self, tcp: &Inner, first: Error) -> Result<Inner, Error> {
        let Inner::Tcp(ch) = tcp else {
            return Err(first);
        };
        if !has_rdma_device() {
            return Err(first);
        }
        let target_port = self
            .host_port()
            .ok()
            .and_then(|h| h.rsplit_once(':').and_then(|(_, p)| p.parse::<u16>().ok()));
        match crate::transport::rdma_port::query(ch).await {
            Ok(Some(port)) if Some(port) != target_port => {
                tracing::debug!(addr = %self.addr, port, "the server announces RDMA on another port");
                rdma_channel_at(self, Some(port), Some(tcp).filter(|_| self.tls))
                    .await
                    .map_err(|e| {
                        Error::RdmaUnavailable(FallbackReason::AnnouncedPort {
                            port,
                            reason: Box::new(e.fallback_reason()),
                        })
                    })
            }
            Ok(_) => Err(first),
            Err(why) => {
                tracing::debug!(addr = %self.addr, %why, "RDMA endpoint query failed");
                Err(first)
            }
        }
    }

    pub(crate) async fn connect_tcp(&self) -> Result<Inner, Error> {
        self.check_target()?;
        let ch = self
            .tcp_endpoint()
            .connect()
            .await
            .map_err(|e| Error::Connect {
                transport: TransportKind::Tcp,
                addr: self.addr.clone(),
                detail: error_chain(&e),
            })?;
        Ok(Inner::Tcp(ch))
    }
}

fn has_rdma_device() -> bool {
    rdma_transport::devices().is_ok_and(|d| !d.is_empty())
}

/// Connects a channel over RDMA; the channel reconnects over RDMA after a
/// connection loss. `tls`: the channel's TLS connection, over which each
/// connection attempt gets its ticket (`crate::transport::ticket`).
pub(crate) async fn rdma_channel(b: &ChannelBuilder, tls: Option<&Inner>) -> Result<Inner, Error> {
    rdma_channel_at(b, None, tls).await
}

/// As [`rdma_channel`], to `port` instead of the target's (an RDMA
/// listener the server announced, `docs/wire-protocol.md` §3).
pub(crate) async fn rdma_channel_at(
    b: &ChannelBuilder,
    port: Option<u16>,
    tls: Option<&Inner>,
) -> Result<Inner, Error> {
    let mut addr = rdma::resolve(&b.host_port()?).await?;
    if let Some(p) = port {
        addr.set_port(p);
    }
    match rdma_transport::devices() {
        Ok(d) if d.is_empty() => return Err(Error::RdmaUnavailable(rdma::no_device_reason())),
        Err(e) => return Err(Error::RdmaUnavailable(rdma::reason(addr, &e))),
        Ok(_) => {}
    }
    let cfg = rdma_transport::Config {
        resolve_timeout: b.rdma_connect_timeout,
        connect_timeout: b.rdma_connect_timeout,
        ..b.rdma_config.clone().unwrap_or_else(rdma::transport_config)
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
                    let ticket = crate::transport::ticket::fetch(ch)
                        .await
                        .map_err(|detail| {
                            Error::RdmaUnavailable(FallbackReason::NoTicket { addr, detail })
                        })?;
                    rdma_transport::connect_with_ticket(addr, &cfg, ticket).await
                }
                None => match local {
                    Some(ip) => rdma_transport::connect_from(ip, addr, &cfg).await,
                    None => rdma_transport::connect(addr, &cfg).await,
                },
            }
            .map_err(|e| Error::RdmaUnavailable(rdma::reason(addr, &e)))?;
            let mut info = ConnInfo::new(TransportKind::Rdma, Some(conn.peer_addr()));
            info.one_sided = Some(crate::info::OneSided(conn.remote_memory()));
            crate::protocol::session::start(RdmaConnection(conn), info, session_cfg, None)
                .await
                .map_err(|st| {
                    Error::RdmaUnavailable(FallbackReason::Handshake {
                        addr,
                        detail: st.message().to_string(),
                    })
                })
        })
    });
    let shared = connector().await?;
    tracing::info!(%addr, "connected over RDMA");
    Ok(msg_inner(shared, Some(connector), b.user_agent.clone()))
}
