//! libibverbs and librdmacm, loaded at run time.
//!
//! No binary built with this crate has `libibverbs.so.1` or `librdmacm.so.1`
//! as a `NEEDED` entry: both are opened with `dlopen` once, on first use
//! ([`load`]), and every function this crate calls is resolved right then,
//! so a host without rdma-core (or with a library lacking one of them) gets a
//! clear [`Error::LibraryUnavailable`] and TCP, never a loader error at
//! start-up nor a missing symbol in the middle of a connection.
//!
//! The functions generated below have the names and C signatures of the
//! library functions they call; the other verbs modules import them by name,
//! which shadows rdma-sys' `extern` declarations of the same names (rdma-sys
//! is still used for the types and constants). The "inline" verbs
//! (`ibv_post_send`, `ibv_post_recv`, `ibv_post_srq_recv`, `ibv_poll_cq`,
//! `ibv_req_notify_cq`, `ibv_alloc_mw`, `ibv_dealloc_mw`) are
//! not library symbols: like the header's `static inline` functions, rdma-sys
//! implements them in Rust as one indirect call through the device context's
//! ops table, so they are still called from rdma-sys directly, unchanged.
//!
//! Each function pointer's Rust type is checked at compile time against
//! rdma-sys' bindgen declaration of the function, which bindgen generated from
//! the installed C headers (`const` blocks in [`library!`]); the C prototype is
//! also written next to each entry.

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

use libloading::Library;
use rdma_sys::{
    ibv_comp_channel, ibv_context, ibv_cq, ibv_device, ibv_device_attr, ibv_gid, ibv_mr, ibv_pd,
    ibv_qp, ibv_qp_attr, ibv_qp_init_attr, ibv_srq, ibv_srq_init_attr, ibv_wc_status,
    rdma_cm_event, rdma_cm_id, rdma_conn_param, rdma_event_channel, rdma_port_space,
};

use crate::error::Error;

/// File name (soname) of libibverbs, as a program linked with `-libverbs`
/// would load it.
pub(crate) const IBVERBS: &str = "libibverbs.so.1";
/// File name (soname) of librdmacm.
pub(crate) const RDMACM: &str = "librdmacm.so.1";

/// Declares a loaded library: a struct with one function pointer per entry,
/// `open` (dlopen + every dlsym, failing on the first missing symbol), a
/// compile-time check of each pointer type against rdma-sys, and one `unsafe
/// fn` per entry with the C function's name that calls through [`loaded`].
///
/// Each entry is `"C prototype" fn name(args) -> ret;`.
macro_rules! library {
    (
        $(#[$meta:meta])*
        struct $Lib:ident, field $field:ident {
            $(
                $proto:literal
                fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)?;
            )*
        }
    ) => {
        $(#[$meta])*
        pub(crate) struct $Lib {
            $(
                #[doc = concat!("`", $proto, "`")]
                $name: unsafe extern "C" fn($($ty),*) $(-> $ret)?,
            )*
            /// Keeps the pointers above valid (never unloaded: see [`LIBS`]).
            _lib: Library,
        }

        // The type of every pointer above is the one bindgen generated for the
        // function from the C header (a coercion of rdma-sys' `extern`
        // function item to the pointer type, evaluated at compile time only:
        // nothing of it reaches the binary, so the symbol stays unreferenced).
        $(
            const _: unsafe extern "C" fn($($ty),*) $(-> $ret)? = rdma_sys::$name;
        )*

        impl $Lib {
            /// Opens `soname` and resolves every entry; the first missing one
            /// fails the whole library.
            fn open(soname: &str) -> Result<$Lib, Error> {
                // SAFETY: loading runs libibverbs'/librdmacm's ELF initialisers,
                // which only set up their own state (safe from any thread).
                let lib = unsafe { Library::new(soname) }
                    .map_err(|e| Error::LibraryUnavailable(e.to_string()))?;
                Ok($Lib {
                    $(
                        // The pointer lives next to `lib`, which is never unloaded.
                        // SAFETY: the field's type is the C prototype `$proto`,
                        // checked above against rdma-sys' declaration (same header).
                        $name: unsafe { symbol(&lib, soname, concat!(stringify!($name), "\0")) }?,
                    )*
                    _lib: lib,
                })
            }
        }

        $(
            #[doc = concat!("Calls `", $proto, "` in the loaded library.")]
            ///
            /// # Safety
            /// The C function's contract (see its rdma-core man page), and the
            /// libraries are loaded ([`load`] returned `Ok`): true wherever an
            /// RDMA object exists, since every one derives from an event
            /// channel or device list obtained after `load`.
            #[inline]
            pub(crate) unsafe fn $name($($arg: $ty),*) $(-> $ret)? {
                // SAFETY: the caller's contract; the pointer was resolved from
                // the library with this prototype (see `open`).
                unsafe { (loaded().$field.$name)($($arg),*) }
            }
        )*
    };
}

/// Resolves one symbol, with the library's name in the error.
///
/// # Safety
/// `T` must be the function pointer type of the C prototype of `name`.
unsafe fn symbol<T: Copy>(lib: &Library, soname: &str, name: &'static str) -> Result<T, Error> {
    // SAFETY: the caller guarantees `T` matches the symbol's prototype.
    unsafe { lib.get::<T>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| {
            let name = name.trim_end_matches('\0');
            Error::LibraryUnavailable(format!("{soname} lacks {name}: {e}"))
        })
}

library! {
    /// The libibverbs functions this crate calls (the inline verbs are not
    /// among them: they go through the device context's ops table).
    struct Ibverbs, field ibverbs {
        "struct ibv_device **ibv_get_device_list(int *num_devices);"
        fn ibv_get_device_list(num_devices: *mut c_int) -> *mut *mut ibv_device;
        "void ibv_free_device_list(struct ibv_device **list);"
        fn ibv_free_device_list(list: *mut *mut ibv_device);
        "const char *ibv_get_device_name(struct ibv_device *device);"
        fn ibv_get_device_name(device: *mut ibv_device) -> *const c_char;
        "__be64 ibv_get_device_guid(struct ibv_device *device);"
        fn ibv_get_device_guid(device: *mut ibv_device) -> u64;
        "struct ibv_pd *ibv_alloc_pd(struct ibv_context *context);"
        fn ibv_alloc_pd(context: *mut ibv_context) -> *mut ibv_pd;
        "int ibv_dealloc_pd(struct ibv_pd *pd);"
        fn ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int;
        "struct ibv_comp_channel *ibv_create_comp_channel(struct ibv_context *context);"
        fn ibv_create_comp_channel(context: *mut ibv_context) -> *mut ibv_comp_channel;
        "int ibv_destroy_comp_channel(struct ibv_comp_channel *channel);"
        fn ibv_destroy_comp_channel(channel: *mut ibv_comp_channel) -> c_int;
        "struct ibv_cq *ibv_create_cq(struct ibv_context *context, int cqe, void *cq_context, \
         struct ibv_comp_channel *channel, int comp_vector);"
        fn ibv_create_cq(
            context: *mut ibv_context,
            cqe: c_int,
            cq_context: *mut c_void,
            channel: *mut ibv_comp_channel,
            comp_vector: c_int,
        ) -> *mut ibv_cq;
        "int ibv_destroy_cq(struct ibv_cq *cq);"
        fn ibv_destroy_cq(cq: *mut ibv_cq) -> c_int;
        "int ibv_get_cq_event(struct ibv_comp_channel *channel, struct ibv_cq **cq, void **cq_context);"
        fn ibv_get_cq_event(
            channel: *mut ibv_comp_channel,
            cq: *mut *mut ibv_cq,
            cq_context: *mut *mut c_void,
        ) -> c_int;
        "void ibv_ack_cq_events(struct ibv_cq *cq, unsigned int nevents);"
        fn ibv_ack_cq_events(cq: *mut ibv_cq, nevents: c_uint);
        "const char *ibv_wc_status_str(enum ibv_wc_status status);"
        fn ibv_wc_status_str(status: ibv_wc_status::Type) -> *const c_char;
        "int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask);"
        fn ibv_modify_qp(qp: *mut ibv_qp, attr: *mut ibv_qp_attr, attr_mask: c_int) -> c_int;
        // The header's `ibv_reg_mr` macro calls this function unless the
        // access flags contain IBV_ACCESS_OPTIONAL_RANGE bits (we never set
        // them: local and remote write only).
        "struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t length, int access);"
        fn ibv_reg_mr(pd: *mut ibv_pd, addr: *mut c_void, length: usize, access: c_int) -> *mut ibv_mr;
        "int ibv_dereg_mr(struct ibv_mr *mr);"
        fn ibv_dereg_mr(mr: *mut ibv_mr) -> c_int;
        "int ibv_query_device(struct ibv_context *context, struct ibv_device_attr *device_attr);"
        fn ibv_query_device(context: *mut ibv_context, device_attr: *mut ibv_device_attr) -> c_int;
        "struct ibv_srq *ibv_create_srq(struct ibv_pd *pd, struct ibv_srq_init_attr *srq_init_attr);"
        fn ibv_create_srq(pd: *mut ibv_pd, srq_init_attr: *mut ibv_srq_init_attr) -> *mut ibv_srq;
        "int ibv_destroy_srq(struct ibv_srq *srq);"
        fn ibv_destroy_srq(srq: *mut ibv_srq) -> c_int;
        "struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *qp_init_attr);"
        fn ibv_create_qp(pd: *mut ibv_pd, qp_init_attr: *mut ibv_qp_init_attr) -> *mut ibv_qp;
        "int ibv_destroy_qp(struct ibv_qp *qp);"
        fn ibv_destroy_qp(qp: *mut ibv_qp) -> c_int;
        "int ibv_query_gid(struct ibv_context *context, uint8_t port_num, int index, union ibv_gid *gid);"
        fn ibv_query_gid(context: *mut ibv_context, port_num: u8, index: c_int, gid: *mut ibv_gid) -> c_int;
    }
}

library! {
    /// The librdmacm functions this crate calls (`rdma_get_local_addr` and
    /// `rdma_get_peer_addr` are inline field accesses, in rdma-sys as in the
    /// header).
    struct Rdmacm, field rdmacm {
        "struct rdma_event_channel *rdma_create_event_channel(void);"
        fn rdma_create_event_channel() -> *mut rdma_event_channel;
        "void rdma_destroy_event_channel(struct rdma_event_channel *channel);"
        fn rdma_destroy_event_channel(channel: *mut rdma_event_channel);
        "int rdma_get_cm_event(struct rdma_event_channel *channel, struct rdma_cm_event **event);"
        fn rdma_get_cm_event(channel: *mut rdma_event_channel, event: *mut *mut rdma_cm_event) -> c_int;
        "int rdma_ack_cm_event(struct rdma_cm_event *event);"
        fn rdma_ack_cm_event(event: *mut rdma_cm_event) -> c_int;
        "int rdma_create_id(struct rdma_event_channel *channel, struct rdma_cm_id **id, \
         void *context, enum rdma_port_space ps);"
        fn rdma_create_id(
            channel: *mut rdma_event_channel,
            id: *mut *mut rdma_cm_id,
            context: *mut c_void,
            ps: rdma_port_space::Type,
        ) -> c_int;
        "int rdma_destroy_id(struct rdma_cm_id *id);"
        fn rdma_destroy_id(id: *mut rdma_cm_id) -> c_int;
        "int rdma_migrate_id(struct rdma_cm_id *id, struct rdma_event_channel *channel);"
        fn rdma_migrate_id(id: *mut rdma_cm_id, channel: *mut rdma_event_channel) -> c_int;
        "int rdma_bind_addr(struct rdma_cm_id *id, struct sockaddr *addr);"
        fn rdma_bind_addr(id: *mut rdma_cm_id, addr: *mut libc::sockaddr) -> c_int;
        "int rdma_listen(struct rdma_cm_id *id, int backlog);"
        fn rdma_listen(id: *mut rdma_cm_id, backlog: c_int) -> c_int;
        "int rdma_resolve_addr(struct rdma_cm_id *id, struct sockaddr *src_addr, \
         struct sockaddr *dst_addr, int timeout_ms);"
        fn rdma_resolve_addr(
            id: *mut rdma_cm_id,
            src_addr: *mut libc::sockaddr,
            dst_addr: *mut libc::sockaddr,
            timeout_ms: c_int,
        ) -> c_int;
        "int rdma_resolve_route(struct rdma_cm_id *id, int timeout_ms);"
        fn rdma_resolve_route(id: *mut rdma_cm_id, timeout_ms: c_int) -> c_int;
        "int rdma_create_qp(struct rdma_cm_id *id, struct ibv_pd *pd, \
         struct ibv_qp_init_attr *qp_init_attr);"
        fn rdma_create_qp(id: *mut rdma_cm_id, pd: *mut ibv_pd, qp_init_attr: *mut ibv_qp_init_attr) -> c_int;
        "void rdma_destroy_qp(struct rdma_cm_id *id);"
        fn rdma_destroy_qp(id: *mut rdma_cm_id);
        "int rdma_connect(struct rdma_cm_id *id, struct rdma_conn_param *conn_param);"
        fn rdma_connect(id: *mut rdma_cm_id, conn_param: *mut rdma_conn_param) -> c_int;
        "int rdma_accept(struct rdma_cm_id *id, struct rdma_conn_param *conn_param);"
        fn rdma_accept(id: *mut rdma_cm_id, conn_param: *mut rdma_conn_param) -> c_int;
        "int rdma_reject(struct rdma_cm_id *id, const void *private_data, uint8_t private_data_len);"
        fn rdma_reject(id: *mut rdma_cm_id, private_data: *const c_void, private_data_len: u8) -> c_int;
        "int rdma_disconnect(struct rdma_cm_id *id);"
        fn rdma_disconnect(id: *mut rdma_cm_id) -> c_int;
    }
}

/// Both libraries. librdmacm itself links libibverbs: the dynamic loader
/// gives it the same libibverbs instance we opened (one soname, one copy),
/// so contexts created by rdma_cm are usable with our libibverbs calls.
struct Libs {
    ibverbs: Ibverbs,
    rdmacm: Rdmacm,
}

impl Libs {
    fn open(ibverbs: &str, rdmacm: &str) -> Result<Libs, Error> {
        Ok(Libs {
            ibverbs: Ibverbs::open(ibverbs)?,
            rdmacm: Rdmacm::open(rdmacm)?,
        })
    }
}

/// Loaded once, on first use; never unloaded (a `static` is never dropped),
/// so the function pointers stay valid for the life of the process. A failed
/// load is remembered too: the reason is the same for the whole process.
static LIBS: OnceLock<Result<Libs, Error>> = OnceLock::new();

/// Loads both libraries if not done yet. `Err(Error::LibraryUnavailable)`
/// says which library is missing or incomplete, e.g. `RDMA libraries not
/// installed (libibverbs.so.1: cannot open shared object file: No such file
/// or directory)`.
pub(crate) fn load() -> Result<(), Error> {
    match LIBS.get_or_init(|| Libs::open(IBVERBS, RDMACM)) {
        Ok(_) => Ok(()),
        Err(e) => Err(e.clone()),
    }
}

/// The loaded libraries. Only called by the generated functions, whose
/// callers hold an RDMA object (which exists only after [`load`] succeeded).
#[inline]
fn loaded() -> &'static Libs {
    match LIBS.get() {
        Some(Ok(libs)) => libs,
        // Unreachable: see the `# Safety` of the generated functions.
        _ => panic!("rdma-transport: verbs call before the RDMA libraries were loaded"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_reported_by_name() {
        let e = Libs::open("libibverbs-not-installed.so.1", RDMACM)
            .err()
            .expect("a library that does not exist cannot load");
        assert!(matches!(e, Error::LibraryUnavailable(_)), "{e:?}");
        let text = e.to_string();
        assert!(
            text.starts_with("RDMA libraries not installed (libibverbs-not-installed.so.1: "),
            "{text}"
        );
        assert!(text.contains("No such file or directory"), "{text}");
        let e = Libs::open(IBVERBS, "librdmacm-not-installed.so.1")
            .err()
            .expect("a library that does not exist cannot load");
        // On a host with libibverbs the failure names librdmacm; without it,
        // libibverbs (opened first).
        let text = e.to_string();
        assert!(
            text.contains("librdmacm-not-installed.so.1: ") || text.contains("libibverbs.so.1: "),
            "{text}"
        );
    }

    #[test]
    fn the_installed_libraries_have_every_function() {
        match Libs::open(IBVERBS, RDMACM) {
            Ok(_) => {}
            // Not installed (e.g. scripts/no-rdma-libs.sh hides them): the
            // other tests cover that path.
            Err(e) if e.to_string().contains("cannot open shared object file") => {
                println!("SKIP the_installed_libraries_have_every_function: {e}")
            }
            // Installed but a name or library is wrong: a bug here.
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn a_library_lacking_a_function_fails_when_opened() {
        // libc is a real library that has none of the verbs functions: the
        // first lookup fails the whole library, naming the function.
        let e = Ibverbs::open("libc.so.6").err().expect("libc has no verbs");
        let text = e.to_string();
        assert!(
            text.starts_with("RDMA libraries not installed (libc.so.6 lacks ibv_get_device_list: "),
            "{text}"
        );
        let e = Rdmacm::open("libc.so.6")
            .err()
            .expect("libc has no rdma_cm");
        assert!(
            e.to_string()
                .contains("libc.so.6 lacks rdma_create_event_channel: "),
            "{e}"
        );
    }
}
