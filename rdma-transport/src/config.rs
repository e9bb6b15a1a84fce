//! The transport's configuration ([`Config`]): every size, limit and
//! timeout of a connection and a listener, with documented defaults, the
//! driver's polling mode ([`PollMode`]), and the ranges they must be in
//! ([`Config::validate`]).

use std::time::Duration;

use crate::engine::wire::HDR_LEN;
use crate::error::{ConfigError, Error};

/// How a connection's driver waits for completions and commands
/// (`docs/wire-protocol-rdma.md` §8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PollMode {
    /// Busy-poll when a spin is likely to pay, then sleep. The driver
    /// measures how long it waits for work when the wait ends awake and
    /// when it ends in a wake-up from the completion channel; the
    /// difference is what a sleep costs this machine. It spins when the
    /// expected wait is within `busy_poll / 2` or within twice a measured
    /// wake-up, for at most twice that wait and 2 ms (or `busy_poll` if
    /// longer), and sleeps at once otherwise; while it does not spin, one
    /// idle period in 16 spins anyway to see whether waits got short. A
    /// spin stops early when its core is crowded (its yields to the runtime
    /// come back much later than usual: other tasks ran, or the host took
    /// the CPU), leaving the core to that work. So a ping-pong whose round
    /// trip is short next to a wake-up is answered without a sleep, an
    /// idle or slow connection costs almost no CPU, and a busy runtime is
    /// not slowed by spinning. The clock is read once every 32 polls, not
    /// every poll (`docs/wire-protocol-rdma.md` §8).
    #[default]
    Adaptive,
    /// Busy-poll for exactly `busy_poll`, then sleep.
    Fixed,
    /// Never arm the completion channel and never sleep: poll the CQ, let
    /// the runtime run other ready tasks (`yield_now`), poll again. Lowest
    /// latency (no interrupt-style wake-up on either side, as perftest and
    /// eRPC do) at the price of a CPU core per busy connection: for
    /// latency-critical users who run the connection on a runtime with a
    /// dedicated thread (e.g. a `current_thread` runtime on its own core).
    /// Timers (keepalive), cm events and commands are still served. On a
    /// multi-thread runtime shared with other work on a busy machine it can
    /// be far slower than `Adaptive` (spinners take turns on the cores:
    /// `docs/benchmarks.md`, "Beside a CPU hog").
    Spin,
}

/// Per-connection (and a few process-wide) limits and tunables.
///
/// Registered memory per connection, with memory on demand (the default,
/// `docs/wire-protocol-rdma.md` §4.6 and §5.5): `initial_recv_slots *
/// recv_slot_bytes + initial_send_slots * recv_slot_bytes` while idle
/// (64 KiB with the defaults); the rings grow to `recv_slots` and
/// `send_slots` under load, and the rendezvous region and the staging
/// buffers (`rendezvous_buffers * rendezvous_buffer_bytes` each, 4 MiB with
/// the defaults) are registered while large messages flow and released after
/// `memory_idle_release` without them. The most a connection registers is
/// `recv_slots * recv_slot_bytes + send_slots * recv_slot_bytes + 2 *
/// rendezvous_buffers * rendezvous_buffer_bytes`: 9 MiB with the defaults,
/// all of it up front with `memory_on_demand: false`.
#[derive(Debug, Clone)]
pub struct Config {
    /// Most receive buffers posted per connection (the most credits the
    /// peer gets). Default 64. Range 4..=4096.
    pub recv_slots: u32,
    /// Receive buffers posted when the connection starts = the peer's
    /// initial credits, with memory on demand; the ring doubles (up to
    /// `recv_slots`) when the peer uses half its credits before they could
    /// be returned (§4.6). Default 4 (the least allowed: an idle connection
    /// holds 32 KiB of receive buffers; `bench --initial-slots` measured no
    /// cost in calls against 16, `docs/benchmarks.md`); above `recv_slots` it
    /// means `recv_slots`.
    pub initial_recv_slots: u32,
    /// Bytes per receive (and send) slot, 32-byte header included.
    /// Default 8192. Minimum 64.
    pub recv_slot_bytes: usize,
    /// Most send slots per connection. Default 64. Minimum 4.
    pub send_slots: u32,
    /// Send slots registered when the connection starts, with memory on
    /// demand; the ring doubles (up to `send_slots`) while messages wait for
    /// a slot, and shrinks back when idle. Default 4, at least 4; above
    /// `send_slots` it means `send_slots`.
    pub initial_send_slots: u32,
    /// Memory on demand (`docs/wire-protocol-rdma.md` §4.6, §5.5): rings
    /// that start small and grow, a rendezvous region registered when the
    /// peer asks for it, staging buffers registered while large messages are
    /// sent, and both given back after `memory_idle_release` without use.
    /// With `false` all of it is registered up front and kept (the region
    /// is advertised in the hello). Default true.
    pub memory_on_demand: bool,
    /// Memory on demand: the rendezvous region, the staging buffers and the
    /// grown send ring are given back once unused for one to two of these
    /// intervals. Zero keeps them once registered. Default 5 s.
    pub memory_idle_release: Duration,
    /// Payloads larger than this go by RDMA WRITE rendezvous; smaller or
    /// equal ones by a single SEND. Capped at `recv_slot_bytes - 32` (and the
    /// peer's slot size). Default 4096.
    pub rendezvous_threshold_bytes: usize,
    /// Bytes per rendezvous buffer (= maximum chunk). Default 256 KiB. Min 4096.
    pub rendezvous_buffer_bytes: usize,
    /// Rendezvous buffers advertised to the peer (and as many local staging
    /// buffers). Default 16: 8 MiB messages in flight at 8 calls of 1 MiB
    /// reached `ib_write_bw` in the Soft-RoCE VM where 8 buffers reached
    /// 0.85x (`docs/benchmarks.md`, large calls). Range 1..=4096.
    pub rendezvous_buffers: u32,
    /// Zero-copy send (`docs/wire-protocol-rdma.md` §5.1): a rendezvous
    /// message whose payload (the `Bytes` handed to `send`, or the body of
    /// `send_parts`) has at least this many bytes is registered for the
    /// time its WRITEs take and written from where it is, instead of being
    /// copied into the staging buffers; the connection holds a reference
    /// to it until the last WRITE's completion. Where the registration
    /// fails, or would pass `global_max_registered_bytes`, it is copied as
    /// below the threshold. 0 turns it off. Default 512 KiB, so that
    /// rpc-core's full DATA frames (1 MiB) qualify: registering and
    /// deregistering 1 MiB cost a third of copying it in the Soft-RoCE VM
    /// and about as much as the copy on a real host, and it took a 16 MiB
    /// call's CPU down by 13–22 % in the VM (`docs/benchmarks.md`, large
    /// calls).
    pub zero_copy_send_bytes: usize,
    /// Messages read by their receiver (`docs/wire-protocol-rdma.md` §5.6):
    /// offered in the hello; where both sides offer it, a rendezvous
    /// message whose payload has at least `zero_copy_send_bytes` (and at
    /// most 1 GiB) is left where it is, readable by the peer alone, and
    /// the peer RDMA-READs it into a buffer of its own that it hands to
    /// the application as it is: no copy on either side. Otherwise, or
    /// where the payload cannot be registered, it is RDMA-WRITTEN as
    /// above. Default on.
    pub read_rendezvous: bool,
    /// Messages written into a destination their receiver grants
    /// (`docs/wire-protocol-rdma.md` §5.7), with `read_rendezvous`:
    /// offered in the hello; where both sides offer it, the receiver of
    /// such a message answers its announcement with a buffer of its own,
    /// writable by that peer alone for that message alone (a memory
    /// window bound to the connection), the sender RDMA-WRITEs the
    /// payload there, and the receiver revokes the window before it hands
    /// the buffer to the application as it is. A WRITE moves at the
    /// device's WRITE speed, which on Soft-RoCE is above its READ's. A
    /// receiver that cannot bind windows (iWARP, or a connection outside
    /// a device's shared PD) reads instead. Default on.
    pub write_destination: bool,
    /// Registered bytes a connection keeps for the buffers of messages it
    /// reads (§5.6): power-of-two buffers of 4 KiB to 4 MiB, made on
    /// first use and reused once the application dropped the message in
    /// them; a message that finds no room gets a buffer registered for it
    /// alone. Counted against `global_max_registered_bytes`. Default 16 MiB.
    pub read_cache_bytes: usize,
    /// Largest message accepted (and sent). Default 1 GiB.
    pub max_message_bytes: usize,
    /// Requested `max_inline_data`; the device may grant less (0 disables
    /// inline). Default 128.
    pub max_inline_bytes: u32,
    /// Request a send completion at least every k-th work request
    /// (selective signalling). Default 16; clamped to half the send slots in
    /// use at the time (`docs/wire-protocol-rdma.md` §7), so a ring that
    /// started small always has slots coming back.
    pub signal_every: u32,
    /// Offer RDMA WRITE with immediate data for rendezvous chunk
    /// notifications (`docs/wire-protocol-rdma.md` §5.4): used when both
    /// sides offer it, which they do on InfiniBand/RoCE devices; iWARP has
    /// no immediate data and keeps the notification SEND. Saves one SEND
    /// (and a send slot) per chunk. Default true.
    pub write_with_imm: bool,
    /// Busy-poll budget before the driver arms the completion channel and
    /// sleeps (`docs/wire-protocol-rdma.md` §8). With
    /// [`PollMode::Adaptive`] (the default): waits within half of it are
    /// always worth a spin, whatever a wake-up costs, and a spin may last
    /// up to the larger of it and 2 ms; with [`PollMode::Fixed`] the budget
    /// itself; ignored by [`PollMode::Spin`]. Default 100 µs (0 disables
    /// busy-polling).
    pub busy_poll: Duration,
    /// How the connection's driver waits for work. Default
    /// [`PollMode::Adaptive`].
    pub poll_mode: PollMode,
    /// Keepalive: a connection that posted nothing for this long posts a
    /// zero-length RDMA WRITE, so a peer whose host died silently (no
    /// disconnect request ever arrives) is detected when the QP's retries
    /// run out, and its registered memory is released. Default 10 s
    /// (zero disables). See `docs/wire-protocol-rdma.md` §4.4.
    pub keepalive: Duration,
    /// Timeout of `rdma_resolve_addr` and of `rdma_resolve_route`. Default 2 s.
    pub resolve_timeout: Duration,
    /// Timeout of the connect / accept handshake. Default 5 s.
    pub connect_timeout: Duration,
    /// Messages the driver queues before `SendHalf::send` waits
    /// (back-pressure). Default 8.
    pub send_queue_messages: usize,
    /// Received messages (bytes, plus 64 per message) queued for the
    /// application before this side stops returning credits, which stops the
    /// peer (`docs/wire-protocol-rdma.md` §4.5). At most about one message,
    /// the receive ring and the rendezvous region more arrive after it.
    /// Default 64 MiB. Minimum 1.
    pub recv_queue_bytes: usize,
    /// Process-wide cap on registered memory (all connections). Default 4 GiB.
    pub global_max_registered_bytes: usize,
    /// `rdma_listen` backlog. Default 128.
    pub listen_backlog: i32,
    /// Listener: connect requests whose handshake (resources, `rdma_accept`,
    /// wait for ESTABLISHED, each bounded by `connect_timeout`) is in
    /// progress at once. Handshakes run concurrently, so a peer that never
    /// completes one delays nobody; one more request is refused
    /// (`rdma_reject`, logged) until one finishes. Default 128.
    pub max_pending_handshakes: usize,
    /// Listener: pending handshakes from one source IP address. Default 64.
    pub max_pending_handshakes_per_address: usize,
    /// Listener: connections from one source IP address, pending
    /// handshakes included (each registers its memory before the peer has
    /// proven anything). One more is refused (`rdma_reject` with reason
    /// "too many connections from this address", logged). Keep it well
    /// below `global_max_registered_bytes` / per-connection bytes, so one
    /// address can never take all of it. Default 128 (640 MiB with the
    /// default sizes, of the 4 GiB default cap).
    pub max_connections_per_address: usize,
    /// Listener: draw the receive buffers of every connection accepted on
    /// one device from a shared receive queue (`docs/wire-protocol-rdma.md`
    /// §4.7) where the device has SRQs and type-2 memory windows (rxe and
    /// most RoCE/InfiniBand NICs; not siw, which keeps per-connection
    /// rings). Credits stay per connection; the pool posts as many buffers
    /// as all connections' credit limits add up to, plus a slack of 16.
    /// Needs `memory_on_demand` and `device_pool`. Default true.
    pub shared_receive_queue: bool,
    /// Listener: most receive buffers one shared receive queue holds
    /// (clamped to the device's `max_srq_wr`). A connection that finds it
    /// full gets a receive ring of its own, as without SRQ. Default 16384
    /// (128 MiB of 8 KiB buffers).
    pub shared_receive_max_buffers: u32,
    /// Register every connection's buffers (ring segments, staging buffers,
    /// rendezvous regions) in one PD per device and process, drawing them
    /// from a pool that keeps the blocks connections let go for the next
    /// one (`docs/buffer-ownership.md`, "Process-wide block pool"), where
    /// the device has type-2 memory windows (not siw: there each connection
    /// keeps a PD of its own). Rendezvous regions are then reached only
    /// through a window bound to their connection's QP (§4.7). Needs
    /// `memory_on_demand`. The first connection on a device sets the pool's
    /// limits (this and `device_pool_idle_bytes`, `memory_idle_release`,
    /// `global_max_registered_bytes`). Default true.
    pub device_pool: bool,
    /// Most bytes of registered blocks a device's pool keeps while no
    /// connection uses them; a block is also let go once unused for a whole
    /// `memory_idle_release` (never with zero). They count in
    /// [`registered_bytes`](crate::registered_bytes). Zero keeps none (every
    /// block is deregistered when its connection lets it go). Default 32 MiB:
    /// what a closed pair of connections that moved large messages gives
    /// back (a 4 MiB region and 4 MiB of staging on each side) and their
    /// ring segments.
    pub device_pool_idle_bytes: usize,
    /// Most bytes one connection exposes to its peer at a time
    /// ([`RemoteMemory::expose`](crate::RemoteMemory::expose), wire
    /// protocol §10): beyond it `expose` fails with
    /// `ResourceError::ExposedBytes`. Exposed bytes are registered memory,
    /// so they also count against `global_max_registered_bytes`.
    /// Default 256 MiB.
    pub max_exposed_bytes: usize,
    /// Most bytes of registered local buffers one connection keeps for its
    /// one-sided READs and WRITEs (wire protocol §10.5): buffers of 4 KiB
    /// to 4 MiB, taken by an operation and given back when it ends (a
    /// READ's `Bytes` of more than 4 KiB is the buffer itself, given back
    /// when dropped), so that operations do not register memory each
    /// time. Made on first use; an operation that finds no room registers
    /// its buffer on the fly. Counts against `global_max_registered_bytes`.
    /// Zero disables the cache. Default 16 MiB.
    pub one_sided_cache_bytes: usize,
    /// How the caller of a lone one-sided READ or WRITE (none other in
    /// flight on the connection) waits for its completion (wire protocol
    /// §10.5), when it differs from `poll_mode`: `Some(PollMode::Spin)`
    /// polls the side CQ until the operation completes (no sleep, no
    /// wake-up; CPU only while the operation is posted); `Adaptive` and
    /// `Fixed` poll for `busy_poll`, then sleep. Operations beside others
    /// wait on the completion channel. The connection's own driver stays
    /// as `poll_mode` says. Default `None`.
    pub one_sided_poll_mode: Option<PollMode>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            recv_slots: 64,
            initial_recv_slots: 4,
            recv_slot_bytes: 8192,
            send_slots: 64,
            initial_send_slots: 4,
            memory_on_demand: true,
            memory_idle_release: Duration::from_secs(5),
            rendezvous_threshold_bytes: 4096,
            rendezvous_buffer_bytes: 256 * 1024,
            rendezvous_buffers: 16,
            zero_copy_send_bytes: 512 << 10,
            read_rendezvous: true,
            write_destination: true,
            read_cache_bytes: 16 << 20,
            max_message_bytes: 1 << 30,
            max_inline_bytes: 128,
            signal_every: 16,
            write_with_imm: true,
            busy_poll: Duration::from_micros(100),
            poll_mode: PollMode::Adaptive,
            keepalive: Duration::from_secs(10),
            resolve_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(5),
            send_queue_messages: 8,
            recv_queue_bytes: 64 << 20,
            global_max_registered_bytes: 4 << 30,
            listen_backlog: 128,
            max_pending_handshakes: 128,
            max_pending_handshakes_per_address: 64,
            max_connections_per_address: 128,
            shared_receive_queue: true,
            shared_receive_max_buffers: 16384,
            device_pool: true,
            device_pool_idle_bytes: 32 << 20,
            max_exposed_bytes: 256 << 20,
            one_sided_cache_bytes: 16 << 20,
            one_sided_poll_mode: None,
        }
    }
}

impl Config {
    /// Checks ranges; called by `connect` and `Listener::bind`.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the first field out of its range and the
    /// rule it breaks ([`ConfigError`]).
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |field, rule| Err(Error::Config(ConfigError { field, rule }));
        if !(4..=4096).contains(&self.recv_slots) {
            return bad("recv_slots", "must be in 4..=4096");
        }
        if self.recv_slot_bytes < HDR_LEN + 32 || self.recv_slot_bytes > (1 << 24) {
            return bad("recv_slot_bytes", "must be in 64..=16 MiB");
        }
        if !(4..=16384).contains(&self.send_slots) {
            return bad("send_slots", "must be in 4..=16384");
        }
        if self.initial_recv_slots < 4 {
            return bad("initial_recv_slots", "must be >= 4");
        }
        if self.initial_send_slots < 4 {
            return bad("initial_send_slots", "must be >= 4");
        }
        if self.rendezvous_buffer_bytes < 4096 || self.rendezvous_buffer_bytes > (1 << 30) {
            return bad("rendezvous_buffer_bytes", "must be in 4096..=1 GiB");
        }
        if !(1..=4096).contains(&self.rendezvous_buffers) {
            return bad("rendezvous_buffers", "must be in 1..=4096");
        }
        if self.max_message_bytes > (1 << 40) {
            return bad("max_message_bytes", "must be at most 1 TiB");
        }
        if self.recv_queue_bytes == 0 {
            return bad("recv_queue_bytes", "must be >= 1");
        }
        if self.max_pending_handshakes == 0 {
            return bad("max_pending_handshakes", "must be >= 1");
        }
        if self.max_pending_handshakes_per_address == 0 {
            return bad("max_pending_handshakes_per_address", "must be >= 1");
        }
        if self.max_connections_per_address == 0 {
            return bad("max_connections_per_address", "must be >= 1");
        }
        if self.send_queue_messages == 0 {
            return bad("send_queue_messages", "must be >= 1");
        }
        Ok(())
    }

    /// Receive slots posted at the start (the hello's credits).
    pub(crate) fn recv_slots_at_start(&self) -> u32 {
        if self.memory_on_demand {
            self.initial_recv_slots.min(self.recv_slots)
        } else {
            self.recv_slots
        }
    }

    /// Send slots registered at the start.
    pub(crate) fn send_slots_at_start(&self) -> u32 {
        if self.memory_on_demand {
            self.initial_send_slots.min(self.send_slots)
        } else {
            self.send_slots
        }
    }

    pub(crate) fn signal_every_eff(&self) -> u32 {
        self.signal_every.clamp(1, (self.send_slots / 2).max(1))
    }
}
