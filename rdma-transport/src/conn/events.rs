//! Waiting for rdma_cm events: the async wrappers of a non-blocking event
//! channel, and the names of events and statuses for errors and logs.

use std::sync::Arc;

use rdma_sys::rdma_cm_event_type as ev;
use tokio::io::unix::AsyncFd;

use super::io_err;
use crate::error::{Errno, Error};
use crate::verbs::cm::{CmEvent, EventChannel};
use crate::verbs::{Cq, FdOwner};

pub(crate) type CmFd = AsyncFd<FdOwner<EventChannel>>;

pub(super) type CqFd = AsyncFd<FdOwner<Cq>>;

/// Waits for the next cm event on a non-blocking channel.
pub(crate) async fn next_event(chan: &Arc<EventChannel>, afd: &CmFd) -> Result<CmEvent, Error> {
    // Readiness first: the driver rebuilds this future every time it sleeps,
    // and a try_get on an empty channel costs a syscall (EAGAIN) and an
    // allocation. Readiness is only cleared after EAGAIN, so no event is missed.
    loop {
        let mut g = afd.readable().await.map_err(|e| io_err("AsyncFd(cm)", e))?;
        match chan.try_get()? {
            Some(e) => return Ok(e),
            None => g.clear_ready(),
        }
    }
}

pub(super) fn event_name(k: u32) -> &'static str {
    match k {
        ev::RDMA_CM_EVENT_ADDR_RESOLVED => "ADDR_RESOLVED",
        ev::RDMA_CM_EVENT_ADDR_ERROR => "ADDR_ERROR",
        ev::RDMA_CM_EVENT_ROUTE_RESOLVED => "ROUTE_RESOLVED",
        ev::RDMA_CM_EVENT_ROUTE_ERROR => "ROUTE_ERROR",
        ev::RDMA_CM_EVENT_CONNECT_REQUEST => "CONNECT_REQUEST",
        ev::RDMA_CM_EVENT_CONNECT_ERROR => "CONNECT_ERROR",
        ev::RDMA_CM_EVENT_UNREACHABLE => "UNREACHABLE",
        ev::RDMA_CM_EVENT_REJECTED => "REJECTED",
        ev::RDMA_CM_EVENT_ESTABLISHED => "ESTABLISHED",
        ev::RDMA_CM_EVENT_DISCONNECTED => "DISCONNECTED",
        ev::RDMA_CM_EVENT_DEVICE_REMOVAL => "DEVICE_REMOVAL",
        ev::RDMA_CM_EVENT_TIMEWAIT_EXIT => "TIMEWAIT_EXIT",
        _ => "other",
    }
}

pub(super) fn status_text(status: i32) -> String {
    if status < 0 {
        format!("{}", Errno(-status))
    } else {
        format!("status {status}")
    }
}
