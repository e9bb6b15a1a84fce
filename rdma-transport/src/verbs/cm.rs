//! rdma_cm objects: event channels ([`EventChannel`]) and communication
//! identifiers ([`CmId`]) with their connect, accept, reject and
//! disconnect calls, the socket-address conversions, and how much private
//! data a connect request and a reject carry.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::RawFd;
use std::sync::Arc;

use rdma_sys::*;

// Named imports shadow rdma-sys' `extern` declarations: these call the
// libraries loaded at run time (see `super::dl`).
use super::dl::{
    rdma_accept, rdma_ack_cm_event, rdma_bind_addr, rdma_connect, rdma_create_event_channel,
    rdma_create_id, rdma_destroy_event_channel, rdma_destroy_id, rdma_disconnect,
    rdma_get_cm_event, rdma_listen, rdma_migrate_id, rdma_reject, rdma_resolve_addr,
    rdma_resolve_route,
};
use super::{errno, set_nonblocking, verb_err, warn_destroy};
use crate::error::{Error, NoDeviceReason};

/// Most private data a connect request carries on InfiniBand/RoCE: the IB
/// CM REQ's 92 bytes less rdma_cm's 36-byte header (iWARP's MPA allows
/// more). A hello with a ticket fills it exactly (wire §2.4).
pub(crate) const CONNECT_PRIVATE_MAX: usize = 56;
/// Most private data a reject carries on InfiniBand/RoCE (the IB CM REJ's;
/// the kernel refuses a longer one with EINVAL).
pub(crate) const REJECT_PRIVATE_MAX: usize = 148;

/// An rdma_cm event channel (fd made non-blocking for tokio's AsyncFd).
pub(crate) struct EventChannel {
    ptr: *mut rdma_event_channel,
}

// SAFETY: librdmacm calls on a channel are thread-safe; the pointer is only
// passed to librdmacm.
unsafe impl Send for EventChannel {}
// SAFETY: as above.
unsafe impl Sync for EventChannel {}

/// A copied-out cm event (the original is acked before this is returned).
pub(crate) struct CmEvent {
    pub kind: u32,
    pub status: i32,
    pub private_data: Vec<u8>,
    /// For CONNECT_REQUEST: the new id (on this channel, owned by the caller).
    pub new_id: Option<CmId>,
}

impl EventChannel {
    pub(crate) fn new() -> Result<Arc<EventChannel>, Error> {
        // Every rdma_cm object starts here: load the libraries (once).
        super::dl::load()?;
        // SAFETY: no arguments; returns NULL on failure.
        let ptr = unsafe { rdma_create_event_channel() };
        if ptr.is_null() {
            let e = errno();
            return Err(match e.0 {
                libc::ENODEV | libc::ENOENT | libc::ENOSYS | libc::ENXIO => {
                    Error::NoDevice(NoDeviceReason::NoRdmaCm { errno: e })
                }
                _ => Error::Verb {
                    verb: "rdma_create_event_channel",
                    errno: e,
                },
            });
        }
        let ch = EventChannel { ptr };
        set_nonblocking(ch.fd(), "fcntl(cm_channel)")?;
        Ok(Arc::new(ch))
    }

    pub(crate) fn fd(&self) -> RawFd {
        // SAFETY: live channel; plain field read.
        unsafe { (*self.ptr).fd }
    }

    /// Non-blocking: `Ok(None)` when no event is pending.
    pub(crate) fn try_get(self: &Arc<Self>) -> Result<Option<CmEvent>, Error> {
        let mut ev: *mut rdma_cm_event = std::ptr::null_mut();
        // SAFETY: live channel (non-blocking fd); out-pointer valid.
        let r = unsafe { rdma_get_cm_event(self.ptr, &mut ev) };
        if r != 0 {
            let e = errno();
            if e.0 == libc::EAGAIN || e.0 == libc::EWOULDBLOCK {
                return Ok(None);
            }
            return Err(Error::Verb {
                verb: "rdma_get_cm_event",
                errno: e,
            });
        }
        // SAFETY: on success `ev` points to a valid event until acked.
        let (kind, status, id) = unsafe { ((*ev).event, (*ev).status, (*ev).id) };
        let mut private_data = Vec::new();
        if matches!(
            kind,
            rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST
                | rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED
                | rdma_cm_event_type::RDMA_CM_EVENT_REJECTED
                | rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_RESPONSE
        ) {
            // SAFETY: for these connected-mode events the `conn` member of
            // the param union is the active one; private_data points to
            // private_data_len bytes valid until the ack.
            unsafe {
                let conn = &(*ev).param.conn;
                if !conn.private_data.is_null() && conn.private_data_len > 0 {
                    private_data = std::slice::from_raw_parts(
                        conn.private_data as *const u8,
                        conn.private_data_len as usize,
                    )
                    .to_vec();
                }
            }
        }
        let new_id = if kind == rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST {
            Some(CmId {
                ptr: id,
                _chan: self.clone(),
            })
        } else {
            None
        };
        // SAFETY: ev came from rdma_get_cm_event and is acked exactly once;
        // everything needed was copied out above.
        let r = unsafe { rdma_ack_cm_event(ev) };
        warn_destroy("rdma_ack_cm_event", r);
        Ok(Some(CmEvent {
            kind,
            status,
            private_data,
            new_id,
        }))
    }
}

impl Drop for EventChannel {
    fn drop(&mut self) {
        // SAFETY: every id on this channel holds an Arc to it, so none remain.
        unsafe { rdma_destroy_event_channel(self.ptr) };
    }
}

/// An rdma_cm identifier (RDMA_PS_TCP, i.e. RC).
pub(crate) struct CmId {
    pub(crate) ptr: *mut rdma_cm_id,
    _chan: Arc<EventChannel>,
}

// SAFETY: librdmacm ids may be used from any thread; pointer only passed to
// librdmacm.
unsafe impl Send for CmId {}
// SAFETY: as above.
unsafe impl Sync for CmId {}

pub(crate) fn to_sockaddr(addr: SocketAddr) -> (libc::sockaddr_storage, usize) {
    // SAFETY: sockaddr_storage is plain C data; zero is valid.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*a.ip()).to_be(),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_in fits in sockaddr_storage (both C structs).
            unsafe { std::ptr::write(&mut ss as *mut _ as *mut libc::sockaddr_in, sin) };
            (ss, std::mem::size_of::<libc::sockaddr_in>())
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_in6 fits in sockaddr_storage.
            unsafe { std::ptr::write(&mut ss as *mut _ as *mut libc::sockaddr_in6, sin6) };
            (ss, std::mem::size_of::<libc::sockaddr_in6>())
        }
    }
}

/// # Safety
/// `sa` must point to a valid sockaddr of the family it declares.
unsafe fn from_sockaddr(sa: *const libc::sockaddr) -> Option<SocketAddr> {
    // SAFETY: caller contract; the family decides the concrete type.
    unsafe {
        match (*sa).sa_family as i32 {
            libc::AF_INET => {
                let sin = &*(sa as *const libc::sockaddr_in);
                Some(SocketAddr::V4(SocketAddrV4::new(
                    Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)),
                    u16::from_be(sin.sin_port),
                )))
            }
            libc::AF_INET6 => {
                let sin6 = &*(sa as *const libc::sockaddr_in6);
                Some(SocketAddr::V6(SocketAddrV6::new(
                    Ipv6Addr::from(sin6.sin6_addr.s6_addr),
                    u16::from_be(sin6.sin6_port),
                    sin6.sin6_flowinfo,
                    sin6.sin6_scope_id,
                )))
            }
            _ => None,
        }
    }
}

fn cm_call(r: i32, verb: &'static str) -> Result<(), Error> {
    if r != 0 {
        Err(verb_err(verb))
    } else {
        Ok(())
    }
}

impl CmId {
    pub(crate) fn new(chan: &Arc<EventChannel>) -> Result<CmId, Error> {
        let mut id: *mut rdma_cm_id = std::ptr::null_mut();
        // SAFETY: live channel; out-pointer valid.
        let r = unsafe {
            rdma_create_id(
                chan.ptr,
                &mut id,
                std::ptr::null_mut(),
                rdma_port_space::RDMA_PS_TCP,
            )
        };
        cm_call(r, "rdma_create_id")?;
        Ok(CmId {
            ptr: id,
            _chan: chan.clone(),
        })
    }

    /// Whether the id's device is iWARP (no immediate data, §5.4). False
    /// while the id is not bound to a device yet.
    pub(crate) fn is_iwarp(&self) -> bool {
        let ctx = self.verbs();
        if ctx.is_null() {
            return false;
        }
        // SAFETY: a bound id's context and its device stay valid while the
        // id lives; plain field reads.
        let tt = unsafe { (*(*ctx).device).transport_type };
        tt == rdma_sys::ibv_transport_type::IBV_TRANSPORT_IWARP
    }

    pub(crate) fn verbs(&self) -> *mut ibv_context {
        // SAFETY: live id; plain field read.
        unsafe { (*self.ptr).verbs }
    }

    /// Moves the id to another event channel (all its events must be acked).
    pub(crate) fn migrate(&mut self, chan: &Arc<EventChannel>) -> Result<(), Error> {
        // SAFETY: live id and channel; our events are acked in try_get.
        let r = unsafe { rdma_migrate_id(self.ptr, chan.ptr) };
        cm_call(r, "rdma_migrate_id")?;
        self._chan = chan.clone();
        Ok(())
    }

    pub(crate) fn bind(&self, addr: SocketAddr) -> Result<(), Error> {
        let (mut ss, _) = to_sockaddr(addr);
        // SAFETY: live id; ss is a valid sockaddr for the call's duration.
        let r = unsafe { rdma_bind_addr(self.ptr, &mut ss as *mut _ as *mut libc::sockaddr) };
        cm_call(r, "rdma_bind_addr")
    }

    pub(crate) fn listen(&self, backlog: i32) -> Result<(), Error> {
        // SAFETY: live, bound id.
        let r = unsafe { rdma_listen(self.ptr, backlog) };
        cm_call(r, "rdma_listen")
    }

    /// Starts address resolution to `dst`, from the local address `src`
    /// when given (else the one routing picks).
    pub(crate) fn resolve_addr(
        &self,
        src: Option<SocketAddr>,
        dst: SocketAddr,
        timeout_ms: i32,
    ) -> Result<(), Error> {
        let (mut ss, _) = to_sockaddr(dst);
        let mut src_ss = src.map(|a| to_sockaddr(a).0);
        let src_ptr = src_ss
            .as_mut()
            .map_or(std::ptr::null_mut(), |s| s as *mut _ as *mut libc::sockaddr);
        // SAFETY: live id; ss (and src_ss, when given) are valid sockaddrs
        // that outlive the call (librdmacm copies them); NULL src is allowed.
        let r = unsafe {
            rdma_resolve_addr(
                self.ptr,
                src_ptr,
                &mut ss as *mut _ as *mut libc::sockaddr,
                timeout_ms,
            )
        };
        cm_call(r, "rdma_resolve_addr")
    }

    pub(crate) fn resolve_route(&self, timeout_ms: i32) -> Result<(), Error> {
        // SAFETY: live id with resolved address.
        let r = unsafe { rdma_resolve_route(self.ptr, timeout_ms) };
        cm_call(r, "rdma_resolve_route")
    }

    /// A connection's queue pair carries the RDMA READs of messages read
    /// by their receiver (wire protocol §5.6): up to `MAX_READS` each way.
    fn param(private: &[u8], qp_num: u32) -> rdma_conn_param {
        Self::param_depth(private, qp_num, crate::engine::wire::MAX_READS as u8)
    }

    /// As `param`, with `depth` RDMA READs outstanding at a time each way
    /// (`initiator_depth`, `responder_resources`; librdmacm lowers them to
    /// what the device and the peer allow).
    fn param_depth(private: &[u8], qp_num: u32, depth: u8) -> rdma_conn_param {
        // Our private data is a hello (44 bytes), with a ticket (56) on
        // connect: within every transport's limit, and within the u8 below.
        debug_assert!(private.len() <= CONNECT_PRIVATE_MAX);
        rdma_conn_param {
            private_data: private.as_ptr() as *const _,
            private_data_len: private.len() as u8,
            responder_resources: depth,
            initiator_depth: depth,
            flow_control: 1,
            // 6, not the maximum 7: rdma_rxe treats a transport retry count
            // of 7 as "retry forever" (like rnr_retry 7), so a peer whose
            // host died silently would never be detected there. With 6 a
            // dead peer fails the QP after ~7 ACK timeouts on every device.
            retry_count: 6,
            // 7 = infinite RNR retries: a safety net only, credits (§4.2)
            // mean a SEND never meets an empty receive queue.
            rnr_retry_count: 7,
            srq: 0,
            // Ignored when the id has a QP (librdmacm sends the QP's number).
            qp_num,
        }
    }

    pub(crate) fn connect(&self, private: &[u8]) -> Result<(), Error> {
        self.connect_qpn(private, 0)
    }

    /// `rdma_connect`; `qp_num` is what the request names when the id has
    /// no QP (only the test helper `testing::StalledConnect` connects
    /// without one: such a connection can never carry data).
    pub(crate) fn connect_qpn(&self, private: &[u8], qp_num: u32) -> Result<(), Error> {
        let mut p = Self::param(private, qp_num);
        // SAFETY: live id with a resolved route (with a QP, or without one,
        // see above); private data valid during the call (librdmacm copies
        // it).
        let r = unsafe { rdma_connect(self.ptr, &mut p) };
        cm_call(r, "rdma_connect")
    }

    /// `rdma_connect` of a queue pair that carries RDMA READs (a side
    /// queue pair, wire protocol §10.2): up to `depth` outstanding each way.
    pub(crate) fn connect_reads(&self, private: &[u8], depth: u8) -> Result<(), Error> {
        let mut p = Self::param_depth(private, 0, depth);
        // SAFETY: live id with a resolved route and a QP; private data
        // valid during the call (librdmacm copies it).
        let r = unsafe { rdma_connect(self.ptr, &mut p) };
        cm_call(r, "rdma_connect")
    }

    /// `rdma_accept` of a queue pair that carries RDMA READs, as
    /// [`CmId::connect_reads`].
    pub(crate) fn accept_reads(&self, private: &[u8], depth: u8) -> Result<(), Error> {
        let mut p = Self::param_depth(private, 0, depth);
        // SAFETY: as for connect.
        let r = unsafe { rdma_accept(self.ptr, &mut p) };
        cm_call(r, "rdma_accept")
    }

    pub(crate) fn accept(&self, private: &[u8]) -> Result<(), Error> {
        let mut p = Self::param(private, 0);
        // SAFETY: as for connect.
        let r = unsafe { rdma_accept(self.ptr, &mut p) };
        cm_call(r, "rdma_accept")
    }

    /// `rdma_reject` with `private` (a reason text), cut to
    /// [`REJECT_PRIVATE_MAX`] bytes so that every transport carries it.
    pub(crate) fn reject(&self, private: &[u8]) {
        let len = private.len().min(REJECT_PRIVATE_MAX) as u8;
        // SAFETY: live id from a CONNECT_REQUEST; `len` bytes of private
        // data are valid during the call (librdmacm copies them).
        let r = unsafe { rdma_reject(self.ptr, private.as_ptr() as *const _, len) };
        warn_destroy("rdma_reject", r);
    }

    pub(crate) fn disconnect(&self) -> Result<(), Error> {
        // SAFETY: live id. Also transitions the QP to the error state.
        let r = unsafe { rdma_disconnect(self.ptr) };
        cm_call(r, "rdma_disconnect")
    }

    pub(crate) fn local_addr(&self) -> Option<SocketAddr> {
        // SAFETY: live id; the route's address storage is valid for its life.
        unsafe { from_sockaddr(rdma_get_local_addr(&*self.ptr)) }
    }

    pub(crate) fn peer_addr(&self) -> Option<SocketAddr> {
        // SAFETY: as above.
        unsafe { from_sockaddr(rdma_get_peer_addr(&*self.ptr)) }
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        // SAFETY: id created by rdma_create_id or delivered by CONNECT_REQUEST;
        // destroyed once. The QP (if any) was destroyed first: Qp holds an
        // Arc<CmId>.
        let r = unsafe { rdma_destroy_id(self.ptr) };
        warn_destroy("rdma_destroy_id", r);
    }
}
