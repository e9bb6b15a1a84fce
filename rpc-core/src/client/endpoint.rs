//! [`Endpoint`] (also named [`ChannelBuilder`]): what a [`Channel`](crate::Channel)
//! connects to and how. It has tonic's `Endpoint` surface with the same
//! argument types (`Uri`, `HeaderValue`, `Option<Duration>`...), so a tonic
//! project compiles after changing its `use tonic::transport::..` line, plus
//! the transport policy and the RDMA settings.
//!
//! The TCP side of a channel *is* a `tonic::transport::Endpoint`: every
//! HTTP/2 and TCP option is handed to it unchanged. Each option's docs say
//! what it means on RDMA connections; "TCP only" means the option has no
//! counterpart there (RDMA has no HTTP/2 framing, no TCP socket), and the
//! docs name what does the job instead. Connecting is in `crate::client`.

use crate::{Error, SessionConfig, Transport};
use bytes::Bytes;
use http::{HeaderValue, Uri};
use std::net::IpAddr;
use std::time::Duration;

/// Re-probe back-off of an `Auto` channel that fell back to TCP.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Reprobe {
    pub(crate) initial: Duration,
    pub(crate) max: Duration,
}

/// Builds a [`Channel`](crate::Channel): tonic's `Endpoint` options with the same
/// signatures, the transport policy and the RDMA settings. `Endpoint` is the
/// same type under tonic's name.
#[derive(Debug, Clone)]
pub struct ChannelBuilder {
    /// The target as given.
    pub(crate) addr: String,
    /// The target as a URI with a scheme (`http://host:port` for `host:port`).
    pub(crate) uri: Uri,
    /// The TCP side: tonic's endpoint with every HTTP/2 and TCP option.
    pub(crate) tcp: tonic::transport::Endpoint,
    /// Whether `tls_config` was given.
    pub(crate) tls: bool,
    /// The `user-agent` sent on message connections (tonic sends its own on TCP).
    pub(crate) user_agent: HeaderValue,
    pub(crate) local_address: Option<IpAddr>,
    pub(crate) transport: Option<Transport>,
    pub(crate) connect_timeout: Duration,
    pub(crate) rdma_connect_timeout: Duration,
    pub(crate) session: SessionConfig,
    pub(crate) rdma_config: Option<rdma_transport::Config>,
    pub(crate) timeout: Option<Duration>,
    pub(crate) concurrency_limit: Option<usize>,
    pub(crate) rate_limit: Option<(u64, Duration)>,
    pub(crate) buffer_size: Option<usize>,
    pub(crate) reprobe: Option<Reprobe>,
    pub(crate) direct_path: bool,
}

/// tonic's name for a channel's builder: `Endpoint::from_static(..).connect()`.
pub type Endpoint = ChannelBuilder;

/// The `user-agent` of calls on message connections: the user's prefix, then
/// this crate's name and version (tonic's HTTP/2 channel sends `<prefix> tonic/<version>`).
const USER_AGENT: &str = concat!("rpc-core/", env!("CARGO_PKG_VERSION"));

/// The `user-agent` of a channel without a `user_agent` prefix.
pub(crate) fn default_user_agent() -> HeaderValue {
    HeaderValue::from_static(USER_AGENT)
}

/// A target: `host:port`, or a URI `http://host:port[/]` or
/// `https://host:port[/]` (port 80 / 443 when the URI has none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Target {
    /// `host:port`, for rdma_cm and for TCP.
    pub(crate) host_port: String,
    /// `https://`.
    pub(crate) https: bool,
}

/// Parses a target (see [`Target`]).
pub(crate) fn parse_target(s: &str) -> Result<Target, Error> {
    let bad = |why: &str| Error::InvalidAddress(format!("{s:?}: {why}"));
    let (hostport, https) = match s.split_once("://") {
        Some((scheme, rest)) => {
            let https = if scheme.eq_ignore_ascii_case("https") {
                true
            } else if scheme.eq_ignore_ascii_case("http") {
                false
            } else {
                return Err(bad("expected an http:// or https:// URI, or host:port"));
            };
            let uri: Uri = s.parse().map_err(|e| bad(&format!("{e}")))?;
            if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
                return Err(bad("a channel's URI has no path"));
            }
            if rest.contains('@') {
                return Err(bad("user info is not supported"));
            }
            let auth = uri.authority().ok_or_else(|| bad("no host"))?;
            let hostport = match auth.port_u16() {
                Some(_) => auth.as_str().to_string(),
                None => format!("{}:{}", auth.host(), if https { 443 } else { 80 }),
            };
            (hostport, https)
        }
        None => (s.trim_end_matches('/').to_string(), false),
    };
    match hostport.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => Ok(Target {
            host_port: hostport,
            https,
        }),
        _ => Err(bad(
            "expected host:port, http://host:port or https://host:port",
        )),
    }
}

impl ChannelBuilder {
    /// A builder for a target (`host:port`, `http://..`, `https://..`), as
    /// given; an invalid one fails at `connect`.
    pub(crate) fn for_target(addr: String) -> ChannelBuilder {
        let uri = match parse_target(&addr) {
            Ok(t) => {
                let scheme = if t.https { "https" } else { "http" };
                Uri::try_from(format!("{scheme}://{}", t.host_port))
                    .unwrap_or_else(|_| Uri::from_static("http://invalid"))
            }
            Err(_) => {
                Uri::try_from(addr.as_str()).unwrap_or_else(|_| Uri::from_static("http://invalid"))
            }
        };
        ChannelBuilder {
            tcp: tonic::transport::Endpoint::from(uri.clone()),
            addr,
            uri,
            tls: false,
            user_agent: HeaderValue::from_static(USER_AGENT),
            local_address: None,
            transport: None,
            connect_timeout: Duration::from_secs(5),
            rdma_connect_timeout: std::env::var(crate::RDMA_CONNECT_TIMEOUT_ENV)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map_or(Duration::from_secs(2), Duration::from_millis),
            session: SessionConfig::default(),
            rdma_config: None,
            timeout: None,
            concurrency_limit: None,
            rate_limit: None,
            buffer_size: None,
            direct_path: true,
            reprobe: Some(Reprobe {
                initial: Duration::from_secs(1),
                max: Duration::from_secs(60),
            }),
        }
    }

    /// An endpoint from anything that converts into one (a `&'static str`,
    /// a `String`, `Bytes`, a `Uri`), as tonic's `Endpoint::new`, which
    /// generated clients' `connect` calls. An `https://` target without a
    /// [`tls_config`](Self::tls_config) gets tonic's default roots (its
    /// `tls-native-roots` / `tls-webpki-roots` features), as with tonic.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidAddress`] if `dst` does not convert, or is `https://`
    /// and no root certificates are available.
    pub fn new<D>(dst: D) -> Result<ChannelBuilder, Error>
    where
        D: TryInto<ChannelBuilder>,
        D::Error: Into<crate::error::BoxError>,
    {
        let me: ChannelBuilder = dst
            .try_into()
            .map_err(|e| Error::InvalidAddress(crate::error::error_chain(&*e.into())))?;
        #[cfg(feature = "tls")]
        if !me.tls && me.uri.scheme() == Some(&http::uri::Scheme::HTTPS) {
            return me.tls_config(crate::ClientTlsConfig::new().with_enabled_roots());
        }
        Ok(me)
    }

    /// A builder from a URI held in a `&'static str` (as tonic's
    /// `Endpoint::from_static`).
    ///
    /// # Panics
    ///
    /// If `s` is not a valid target (as tonic's panics on an invalid URI).
    pub fn from_static(s: &'static str) -> ChannelBuilder {
        match Self::from_shared(s) {
            Ok(b) => b,
            Err(e) => panic!("{e}"),
        }
    }

    /// A builder from `http://host:port`, `https://host:port` or `host:port`
    /// (as tonic's `Endpoint::from_shared`).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidAddress`] if it is none of these.
    pub fn from_shared(s: impl Into<Bytes>) -> Result<ChannelBuilder, Error> {
        let b: Bytes = s.into();
        let s = std::str::from_utf8(&b)
            .map_err(|e| Error::InvalidAddress(format!("{b:?}: {e}")))?
            .to_string();
        parse_target(&s)?;
        Ok(ChannelBuilder::for_target(s))
    }

    /// The target as given (`host:port`, `http://host:port`...).
    pub fn address(&self) -> &str {
        &self.addr
    }

    /// The endpoint's URI (as tonic's `Endpoint::uri`); `host:port` reads
    /// as `http://host:port`.
    pub fn uri(&self) -> &Uri {
        &self.uri
    }

    /// Which transport to use; default [`Transport::Auto`] unless the
    /// `RPC_TRANSPORT` environment variable (`auto`, `rdma`, `tcp`) says otherwise.
    pub fn transport(mut self, t: Transport) -> Self {
        self.transport = Some(t);
        self
    }

    /// A `user-agent` prefix (as tonic's): calls carry `<user_agent>
    /// tonic/<version>` over TCP and `<user_agent> rpc-core/<version>` over
    /// RDMA and in-memory connections, so handlers see it on both.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidAddress`] if it is not a valid header value.
    pub fn user_agent<T>(mut self, user_agent: T) -> Result<Self, Error>
    where
        T: TryInto<HeaderValue>,
    {
        let ua = user_agent
            .try_into()
            .map_err(|_| Error::InvalidAddress("user-agent is not a valid header value".into()))?;
        let mut v = ua.as_bytes().to_vec();
        v.push(b' ');
        v.extend_from_slice(USER_AGENT.as_bytes());
        self.user_agent = HeaderValue::from_bytes(&v)
            .map_err(|_| Error::InvalidAddress("user-agent is not a valid header value".into()))?;
        self.tcp = self
            .tcp
            .user_agent(ua)
            .map_err(|e| Error::InvalidAddress(crate::error::error_chain(&e)))?;
        Ok(self)
    }

    /// The `:authority` (and TLS server name) of HTTP/2 requests (as
    /// tonic's). TCP only: calls on message connections carry no authority.
    pub fn origin(mut self, origin: Uri) -> Self {
        self.tcp = self.tcp.origin(origin);
        self
    }

    /// Whether clients compiled with `rpc_codegen` take the direct path
    /// over this channel's message connections (see
    /// [`Channel::direct_path`](crate::Channel::direct_path)). Default: `true`.
    pub fn direct_path(mut self, enable: bool) -> Self {
        self.direct_path = enable;
        self
    }

    /// A deadline for every call that has none shorter (as tonic's
    /// `Endpoint::timeout`). It travels as the call's `grpc-timeout`, so the
    /// server sees it too, and the call ends `DEADLINE_EXCEEDED`.
    pub fn timeout(mut self, d: Duration) -> Self {
        self.timeout = Some(d);
        self
    }

    /// Time allowed to establish the TCP connection (default 5 s). RDMA's
    /// setup has its own, [`rdma_connect_timeout`](Self::rdma_connect_timeout).
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d;
        self
    }

    /// TCP keepalive of the TCP connection (as tonic's). RDMA connections
    /// detect a dead peer with their own keepalive (`RdmaConfig::keepalive`,
    /// 10 s by default; see [`http2_keep_alive_interval`](Self::http2_keep_alive_interval)).
    pub fn tcp_keepalive(mut self, d: Option<Duration>) -> Self {
        self.tcp = self.tcp.tcp_keepalive(d);
        self
    }

    /// TCP keepalive probe interval (as tonic's). TCP only.
    pub fn tcp_keepalive_interval(mut self, d: Option<Duration>) -> Self {
        self.tcp = self.tcp.tcp_keepalive_interval(d);
        self
    }

    /// TCP keepalive probe count (as tonic's). TCP only.
    pub fn tcp_keepalive_retries(mut self, n: Option<u32>) -> Self {
        self.tcp = self.tcp.tcp_keepalive_retries(n);
        self
    }

    /// At most `limit` calls at once on this channel, its clones together
    /// (`tower::limit::ConcurrencyLimit`, as tonic's); more wait. Every transport.
    pub fn concurrency_limit(mut self, limit: usize) -> Self {
        self.concurrency_limit = Some(limit);
        self
    }

    /// At most `num` calls per `per` on this channel, its clones together
    /// (`tower::limit::RateLimit`, as tonic's); more wait. Every transport.
    pub fn rate_limit(mut self, num: u64, per: Duration) -> Self {
        self.rate_limit = Some((num, per));
        self
    }

    /// The initial per-call flow-control window (as tonic's HTTP/2 stream
    /// window): on TCP the HTTP/2 setting, on message connections the
    /// call protocol's per-call window ([`SessionConfig::initial_window`]).
    pub fn initial_stream_window_size(mut self, sz: impl Into<Option<u32>>) -> Self {
        let sz = sz.into();
        if let Some(w) = sz {
            self.session.initial_window = w.max(1);
        }
        self.tcp = self.tcp.initial_stream_window_size(sz);
        self
    }

    /// The initial per-connection flow-control window: on TCP the HTTP/2
    /// setting, on message connections [`SessionConfig::connection_window`].
    pub fn initial_connection_window_size(mut self, sz: impl Into<Option<u32>>) -> Self {
        let sz = sz.into();
        if let Some(w) = sz {
            self.session.connection_window = w.max(1);
        }
        self.tcp = self.tcp.initial_connection_window_size(sz);
        self
    }

    /// Calls queued in front of a shared channel service (a channel with
    /// limits, or balanced), as tonic's (default 1024). Every transport.
    pub fn buffer_size(mut self, sz: impl Into<Option<usize>>) -> Self {
        let sz = sz.into();
        self.buffer_size = sz;
        self.tcp = self.tcp.buffer_size(sz);
        self
    }

    /// TLS for the TCP side (tonic's `ClientTlsConfig`, as tonic's), and the
    /// key to RDMA with a TLS server: the channel first connects over TLS,
    /// gets a one-time ticket over it, and presents the ticket in its RDMA
    /// connect request; the server admits no RDMA connection without one
    /// (`docs/wire-protocol-rdma.md` §2.4). The target must be `https://`.
    ///
    /// # Errors
    ///
    /// [`Error::Tls`] if tonic refuses the configuration.
    #[cfg(feature = "tls")]
    pub fn tls_config(mut self, tls_config: crate::ClientTlsConfig) -> Result<Self, Error> {
        self.tcp = self
            .tcp
            .tls_config(tls_config)
            .map_err(|e| Error::Tls(crate::error::error_chain(&e)))?;
        self.tls = true;
        Ok(self)
    }

    /// `TCP_NODELAY` on the TCP connection (default on, as tonic's). TCP
    /// only: RDMA sends each message when it is posted.
    pub fn tcp_nodelay(mut self, enabled: bool) -> Self {
        self.tcp = self.tcp.tcp_nodelay(enabled);
        self
    }

    /// HTTP/2 keepalive PING interval (as tonic's); on RDMA connections the
    /// transport's keepalive interval (`RdmaConfig::keepalive`), which finds
    /// a vanished peer the same way.
    pub fn http2_keep_alive_interval(mut self, interval: Duration) -> Self {
        let mut cfg = self
            .rdma_config
            .take()
            .unwrap_or_else(crate::transport::rdma::transport_config);
        cfg.keepalive = interval;
        self.rdma_config = Some(cfg);
        self.tcp = self.tcp.http2_keep_alive_interval(interval);
        self
    }

    /// How long an HTTP/2 keepalive PING may wait for its answer (as
    /// tonic's). On RDMA a keepalive that is not acknowledged fails at the
    /// NIC after its retries (`RdmaConfig::keepalive`'s docs).
    pub fn keep_alive_timeout(mut self, d: Duration) -> Self {
        self.tcp = self.tcp.keep_alive_timeout(d);
        self
    }

    /// HTTP/2 keepalive also while no call is open (as tonic's). RDMA's
    /// keepalive always runs on an idle connection.
    pub fn keep_alive_while_idle(mut self, enabled: bool) -> Self {
        self.tcp = self.tcp.keep_alive_while_idle(enabled);
        self
    }

    /// HTTP/2 adaptive flow-control window (as tonic's). TCP only.
    pub fn http2_adaptive_window(mut self, enabled: bool) -> Self {
        self.tcp = self.tcp.http2_adaptive_window(enabled);
        self
    }

    /// HPACK header table size (as tonic's). TCP only: message connections
    /// do not compress metadata.
    pub fn http2_header_table_size(mut self, size: u32) -> Self {
        self.tcp = self.tcp.http2_header_table_size(size);
        self
    }

    /// Largest response metadata accepted (as tonic's): the HTTP/2 setting
    /// on TCP, [`SessionConfig::max_metadata_bytes`] on message connections.
    pub fn http2_max_header_list_size(mut self, size: u32) -> Self {
        self.session.max_metadata_bytes = size.max(1);
        self.tcp = self.tcp.http2_max_header_list_size(size);
        self
    }

    /// HTTP/2 reset-stream limits (as tonic's). TCP only.
    pub fn http2_max_concurrent_reset_streams(mut self, max: usize) -> Self {
        self.tcp = self.tcp.http2_max_concurrent_reset_streams(max);
        self
    }

    /// HTTP/2 reset-stream memory (as tonic's). TCP only.
    pub fn http2_reset_stream_duration(mut self, d: Duration) -> Self {
        self.tcp = self.tcp.http2_reset_stream_duration(d);
        self
    }

    /// HTTP/2 locally reset streams allowed (as tonic's). TCP only.
    pub fn http2_max_local_error_reset_streams(mut self, max: impl Into<Option<usize>>) -> Self {
        self.tcp = self.tcp.http2_max_local_error_reset_streams(max);
        self
    }

    /// Largest HTTP/2 frame (as tonic's). TCP only: on message connections
    /// a call's DATA frames are at most [`SessionConfig::max_data_frame`].
    pub fn max_frame_size(mut self, frame_size: impl Into<Option<u32>>) -> Self {
        self.tcp = self.tcp.max_frame_size(frame_size);
        self
    }

    /// The local address connections leave from (as tonic's): the TCP
    /// socket's, and on RDMA the source address of the connect request.
    pub fn local_address(mut self, addr: Option<IpAddr>) -> Self {
        self.local_address = addr;
        self.tcp = self.tcp.local_address(addr);
        self
    }

    /// The executor tonic's HTTP/2 channel spawns its tasks on (as tonic's;
    /// default `tokio::spawn`). TCP only: RDMA connections run their driver
    /// on the Tokio runtime that connects them.
    pub fn executor<E>(mut self, executor: E) -> Self
    where
        E: hyper::rt::Executor<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>>
            + Send
            + Sync
            + 'static,
    {
        self.tcp = self.tcp.executor(executor);
        self
    }

    /// `TCP_NODELAY` setting (as tonic's getter).
    pub fn get_tcp_nodelay(&self) -> bool {
        self.tcp.get_tcp_nodelay()
    }

    /// The TCP connect timeout (as tonic's getter).
    pub fn get_connect_timeout(&self) -> Option<Duration> {
        Some(self.connect_timeout)
    }

    /// The TCP keepalive setting (as tonic's getter).
    pub fn get_tcp_keepalive(&self) -> Option<Duration> {
        self.tcp.get_tcp_keepalive()
    }

    /// The TCP keepalive interval (as tonic's getter).
    pub fn get_tcp_keepalive_interval(&self) -> Option<Duration> {
        self.tcp.get_tcp_keepalive_interval()
    }

    /// The TCP keepalive probe count (as tonic's getter).
    pub fn get_tcp_keepalive_retries(&self) -> Option<u32> {
        self.tcp.get_tcp_keepalive_retries()
    }

    /// Time allowed for RDMA address/route resolution and connection before
    /// falling back to TCP (default 2 s, or `RPC_RDMA_CONNECT_TIMEOUT_MS`).
    /// It overrides the timeouts of [`rdma_config`](Self::rdma_config).
    pub fn rdma_connect_timeout(mut self, d: Duration) -> Self {
        self.rdma_connect_timeout = d;
        self
    }

    /// Call-protocol limits used on message (RDMA, in-memory) connections.
    pub fn session_config(mut self, c: SessionConfig) -> Self {
        self.session = c;
        self
    }

    /// rdma-transport's settings (buffer sizes, queue depths, inline and
    /// eager limits, how completions are waited for...) for this channel's
    /// RDMA connections. Default: the transport's defaults with
    /// `max_message_bytes` = 16 MiB.
    ///
    /// A latency-critical client that gives its connection a core polls
    /// instead of sleeping on completion events:
    ///
    /// ```no_run
    /// # async fn f() -> Result<(), rpc_core::Error> {
    /// use rpc_core::{Channel, PollMode, RdmaConfig};
    /// let channel = Channel::from_static("http://10.0.0.1:50051")
    ///     .rdma_config(RdmaConfig {
    ///         poll_mode: PollMode::Spin,
    ///         max_message_bytes: rpc_core::MAX_RDMA_FRAME,
    ///         ..RdmaConfig::default()
    ///     })
    ///     .connect()
    ///     .await?;
    /// # drop(channel); Ok(()) }
    /// ```
    pub fn rdma_config(mut self, c: rdma_transport::Config) -> Self {
        self.rdma_config = Some(c);
        self
    }

    /// Re-probe back-off of an `Auto` channel that fell back to TCP: RDMA is
    /// tried again after `initial`, then at doubling intervals up to `max`
    /// (default 1 s doubling to 60 s); see [`Channel::transport`](crate::Channel::transport).
    pub fn rdma_reprobe(mut self, initial: Duration, max: Duration) -> Self {
        self.reprobe = Some(Reprobe {
            initial: initial.max(Duration::from_millis(1)),
            max: max.max(initial),
        });
        self
    }

    /// An `Auto` channel that fell back to TCP stays on TCP.
    pub fn no_rdma_reprobe(mut self) -> Self {
        self.reprobe = None;
        self
    }

    /// The target's `host:port` and scheme.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidAddress`] for an invalid target.
    pub(crate) fn target(&self) -> Result<Target, Error> {
        parse_target(&self.addr)
    }

    /// The target's `host:port`.
    pub(crate) fn host_port(&self) -> Result<String, Error> {
        Ok(self.target()?.host_port)
    }
}

impl From<Uri> for ChannelBuilder {
    fn from(uri: Uri) -> Self {
        ChannelBuilder::for_target(uri.to_string())
    }
}

impl TryFrom<Bytes> for ChannelBuilder {
    type Error = Error;
    fn try_from(t: Bytes) -> Result<Self, Error> {
        Self::from_shared(t)
    }
}

impl TryFrom<String> for ChannelBuilder {
    type Error = Error;
    fn try_from(t: String) -> Result<Self, Error> {
        Self::from_shared(t)
    }
}

impl TryFrom<&'static str> for ChannelBuilder {
    type Error = Error;
    fn try_from(t: &'static str) -> Result<Self, Error> {
        Self::from_shared(t)
    }
}

impl std::str::FromStr for ChannelBuilder {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        Self::from_shared(s.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_as_tonic_users_write_them() {
        let t = |s| parse_target(s).map(|t| (t.host_port, t.https));
        assert_eq!(
            t("10.0.0.1:50051").unwrap(),
            ("10.0.0.1:50051".into(), false)
        );
        assert_eq!(
            t("http://[::1]:50051/").unwrap(),
            ("[::1]:50051".into(), false)
        );
        assert_eq!(
            t("https://example.com").unwrap(),
            ("example.com:443".into(), true)
        );
        assert_eq!(
            t("http://example.com").unwrap(),
            ("example.com:80".into(), false)
        );
        for bad in [
            "ftp://a:1",
            "http://a:1/path",
            "http://u@a:1",
            "a",
            ":1",
            "a:x",
        ] {
            assert!(
                matches!(parse_target(bad), Err(Error::InvalidAddress(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn conversions_match_tonics() {
        let e: Endpoint = "http://127.0.0.1:1".try_into().unwrap();
        assert_eq!(e.uri(), &Uri::from_static("http://127.0.0.1:1"));
        let e = Endpoint::new(String::from("127.0.0.1:2")).unwrap();
        assert_eq!(e.uri(), &Uri::from_static("http://127.0.0.1:2"));
        let e = Endpoint::from(Uri::from_static("http://127.0.0.1:3"));
        assert_eq!(e.host_port().unwrap(), "127.0.0.1:3");
        let e: Endpoint = "http://127.0.0.1:4".parse().unwrap();
        assert_eq!(e.address(), "http://127.0.0.1:4");
        assert!(Endpoint::new("http://a:1/x").is_err());
        let e = Endpoint::new(Bytes::from_static(b"http://127.0.0.1:5")).unwrap();
        assert_eq!(e.host_port().unwrap(), "127.0.0.1:5");
    }

    #[test]
    fn options_reach_the_message_path_where_they_have_a_meaning() {
        let e = Endpoint::from_static("http://127.0.0.1:1")
            .initial_stream_window_size(1 << 20)
            .initial_connection_window_size(Some(8 << 20))
            .http2_max_header_list_size(4096)
            .http2_keep_alive_interval(Duration::from_secs(3))
            .user_agent("my-app/1")
            .unwrap();
        assert_eq!(e.session.initial_window, 1 << 20);
        assert_eq!(e.session.connection_window, 8 << 20);
        assert_eq!(e.session.max_metadata_bytes, 4096);
        assert_eq!(e.rdma_config.unwrap().keepalive, Duration::from_secs(3));
        assert_eq!(
            e.user_agent.to_str().unwrap(),
            concat!("my-app/1 rpc-core/", env!("CARGO_PKG_VERSION"))
        );
        assert!(Endpoint::from_static("http://a:1")
            .user_agent("bad\nvalue")
            .is_err());
    }
}
