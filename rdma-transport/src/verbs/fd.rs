//! Watching the file descriptor of an event or completion channel with
//! tokio's reactor ([`async_fd`]), its owner kept alive meanwhile.

use std::os::fd::RawFd;
use std::sync::Arc;

use super::{cm, Cq};
use crate::error::{Errno, Error};

/// Objects owning a file descriptor that can be watched with tokio.
pub(crate) trait HasFd {
    fn raw_fd(&self) -> RawFd;
}

impl HasFd for cm::EventChannel {
    fn raw_fd(&self) -> RawFd {
        self.fd()
    }
}

impl HasFd for Cq {
    fn raw_fd(&self) -> RawFd {
        self.channel_fd()
    }
}

/// Keeps the fd's owner alive for as long as tokio watches the fd.
pub(crate) struct FdOwner<T: HasFd>(Arc<T>);

impl<T: HasFd> std::os::fd::AsRawFd for FdOwner<T> {
    fn as_raw_fd(&self) -> RawFd {
        self.0.raw_fd()
    }
}

/// Registers the (non-blocking) fd of `owner` with the tokio reactor.
pub(crate) fn async_fd<T: HasFd>(
    owner: Arc<T>,
) -> Result<tokio::io::unix::AsyncFd<FdOwner<T>>, Error> {
    // The fd belongs to `owner` (event/completion channel), which the FdOwner
    // keeps alive (Arc) for the AsyncFd's whole lifetime.
    // SAFETY: so the fd stays open and always refers to the same file
    // description, and as_raw_fd always returns that same fd.
    unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(
            FdOwner(owner),
            tokio::io::Interest::READABLE,
        )
    }
    .map_err(|e| Error::Verb {
        verb: "AsyncFd::register",
        errno: Errno(std::io::Error::from(e).raw_os_error().unwrap_or(0)),
    })
}
