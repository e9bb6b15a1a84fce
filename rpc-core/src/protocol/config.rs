//! Limits of the call protocol on one message connection ([`SessionConfig`]).

use std::time::Duration;

/// Limits of the call protocol on one message connection (`docs/wire-protocol.md` §1.5).
#[derive(Debug, Clone)]
pub struct SessionConfig {
    /// Calls this side accepts at once on one connection (default 2048).
    pub max_concurrent_calls: u32,
    /// DATA bytes per call the peer may send before credit returns (default 4 MiB).
    pub initial_window: u32,
    /// DATA bytes the peer may send on the whole connection before credit
    /// returns (default 32 MiB): bounds what a connection can make this side buffer.
    pub connection_window: u32,
    /// Largest metadata block (names + values) accepted in one frame (default 16 KiB).
    pub max_metadata_bytes: u32,
    /// Largest DATA payload per frame sent (default 1 MiB minus the 6-byte
    /// frame header, so that a full DATA frame is exactly 1 MiB: four whole
    /// rendezvous buffers of rdma-transport's default 256 KiB, not five).
    /// A body's last frame may carry up to 1/64 more, so that a message
    /// just over a frame leaves as one.
    pub max_data_frame: usize,
    /// Time allowed for the HELLO exchange (default 5 s).
    pub handshake_timeout: Duration,
    /// Small frames queued together are sent as one connection message of at
    /// most this many bytes (BATCH, §1.7; default 4 KiB, which keeps a batch
    /// under rdma-transport's default eager limit). 0 disables batching.
    pub max_batch_bytes: usize,
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig {
            max_concurrent_calls: 2048,
            initial_window: 4 << 20,
            connection_window: 32 << 20,
            max_metadata_bytes: 16 << 10,
            max_data_frame: (1 << 20) - super::frame::HEADER_LEN,
            handshake_timeout: Duration::from_secs(5),
            max_batch_bytes: 4096,
        }
    }
}
