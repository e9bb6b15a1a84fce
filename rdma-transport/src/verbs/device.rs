//! The RDMA devices of the host: the list [`devices`] reports, and what
//! the device of a bound cm_id offers (memory windows, shared receive
//! queues).

use std::ffi::CStr;

use rdma_sys::*;

use super::cm;
use super::dl;
// Named imports shadow rdma-sys' `extern` declarations: these call the
// libraries loaded at run time (see `dl`).
use super::dl::{
    ibv_free_device_list, ibv_get_device_guid, ibv_get_device_list, ibv_get_device_name,
    ibv_query_device,
};
use super::errno;
use crate::error::{Errno, Error};
use crate::DeviceInfo;

/// Lists RDMA devices. A kernel without RDMA (ENOSYS, no sysfs class) or a
/// host without the RDMA libraries yields an empty list, never an error or a
/// crash.
pub fn devices() -> Result<Vec<DeviceInfo>, Error> {
    if dl::load().is_err() {
        return Ok(Vec::new());
    }
    let mut n: i32 = 0;
    // SAFETY: ibv_get_device_list writes the count into `n` and returns a
    // NULL-terminated array (or NULL on failure).
    let list = unsafe { ibv_get_device_list(&mut n) };
    if list.is_null() {
        let e = errno();
        return match e.0 {
            0 | libc::ENOSYS | libc::ENOENT | libc::ENODEV | libc::EPERM | libc::EACCES => {
                Ok(Vec::new())
            }
            _ => Err(Error::Verb {
                verb: "ibv_get_device_list",
                errno: e,
            }),
        };
    }
    let mut out = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: `list` has `n` valid entries (documented contract).
        let dev = unsafe { *list.add(i) };
        if dev.is_null() {
            break;
        }
        // SAFETY: dev is a valid ibv_device from the list; the name is a
        // NUL-terminated string inside it, valid until ibv_free_device_list.
        let name = unsafe { CStr::from_ptr(ibv_get_device_name(dev)) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: dev is valid (see above).
        let guid = u64::from_be(unsafe { ibv_get_device_guid(dev) });
        // SAFETY: dev is valid; reading a plain field.
        let tt = unsafe { (*dev).transport_type };
        let transport = match tt {
            ibv_transport_type::IBV_TRANSPORT_IB => "InfiniBand/RoCE",
            ibv_transport_type::IBV_TRANSPORT_IWARP => "iWARP",
            _ => "other",
        };
        out.push(DeviceInfo {
            name,
            guid,
            transport,
        });
    }
    // SAFETY: list came from ibv_get_device_list and is freed exactly once.
    unsafe { ibv_free_device_list(list) };
    Ok(out)
}

/// The device attributes of a bound cm_id (`None`: not bound, or the query
/// failed).
fn query_device(id: &cm::CmId) -> Option<ibv_device_attr> {
    let ctx = id.verbs();
    if ctx.is_null() {
        return None;
    }
    // SAFETY: ibv_device_attr is plain C data; zero is valid.
    let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
    // SAFETY: ctx is the live device context of the bound id (held by it);
    // attr is a valid out-pointer.
    let r = unsafe { ibv_query_device(ctx, &mut attr) };
    if r != 0 {
        tracing::debug!("ibv_query_device failed: {}", Errno(r));
        return None;
    }
    Some(attr)
}

/// Whether the device of a bound cm_id has type-2 memory windows, which a
/// shared PD needs: there, rendezvous regions are reached only through
/// windows bound to one QP (wire protocol §4.7). siw has none.
pub(crate) fn window_support(id: &cm::CmId) -> bool {
    query_device(id).is_some_and(|attr| {
        attr.max_mw > 0
            && attr.device_cap_flags
                & (ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2A.0
                    | ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2B.0)
                != 0
    })
}

/// What the device of a bound cm_id offers for a listener's shared receive
/// queue (wire protocol §4.7): `Some(max_srq_wr)` when it has SRQs, `None`
/// otherwise or when the device cannot be queried. (The shared PD it lives
/// in also needs [`window_support`].)
pub(crate) fn shared_receive_support(id: &cm::CmId) -> Option<u32> {
    query_device(id).and_then(|attr| {
        (attr.max_srq > 0 && attr.max_srq_wr > 0).then_some(attr.max_srq_wr as u32)
    })
}
