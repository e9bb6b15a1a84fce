//! RDMA: the [`Connection`](crate::conn::Connection) over rdma-transport, and
//! the RDMA side of [`Channel`](crate::Channel) and [`Server`](crate::Server).

use crate::client::ChannelBuilder;
use crate::{Channel, Error};

/// Connects a channel over RDMA.
pub(crate) async fn connect_channel(_b: &ChannelBuilder) -> Result<Channel, Error> {
    Err(Error::RdmaUnavailable(
        "this build has no RDMA support yet".to_string(),
    ))
}

/// Starts the RDMA listener for a server on `addr`, if this host can.
pub(crate) async fn start_listener(
    _addr: std::net::SocketAddr,
    _router: crate::Router,
    _sessions: crate::server::Sessions,
    _stop: tokio::sync::watch::Receiver<bool>,
    _tasks: &mut tokio::task::JoinSet<Result<(), Error>>,
) -> Option<std::net::SocketAddr> {
    None
}
