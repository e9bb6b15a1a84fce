//! Counters: each connection's ([`ConnStats`], updated by its driver) and
//! the process-wide totals of every connection, closed ones included
//! ([`crate::global_stats`]).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::engine::EngineCounters;

macro_rules! stats {
    ($($(#[$m:meta])* $f:ident),* $(,)?) => {
        /// Live counters of one connection (see also [`global_stats`](crate::global_stats)).
        #[derive(Debug, Default)]
        pub struct ConnStats { $($(#[$m])* pub $f: AtomicU64,)* }

        /// A copy of counters at one point in time.
        #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
        pub struct StatsSnapshot { $($(#[$m])* pub $f: u64,)* }

        impl StatsSnapshot {
            /// Every counter with its name, in declaration order (for
            /// exporting them, or printing the ones that moved).
            pub fn named(&self) -> impl Iterator<Item = (&'static str, u64)> {
                [$((stringify!($f), self.$f),)*].into_iter()
            }
        }

        impl ConnStats {
            const fn new_const() -> ConnStats { ConnStats { $($f: AtomicU64::new(0),)* } }
            /// Reads all counters.
            pub fn snapshot(&self) -> StatsSnapshot {
                StatsSnapshot { $($f: self.$f.load(Relaxed),)* }
            }
        }
    };
}

stats! {
    /// Messages sent (fully handed to the NIC).
    msgs_sent,
    /// Messages received.
    msgs_recv,
    /// Payload bytes sent.
    bytes_sent,
    /// Payload bytes received.
    bytes_recv,
    /// Messages sent eagerly (one SEND).
    eager_sends,
    /// SENDs posted with IBV_SEND_INLINE.
    inline_sends,
    /// RDMA WRITEs posted for rendezvous chunks.
    rendezvous_writes,
    /// Bytes moved by rendezvous RDMA WRITEs.
    rendezvous_bytes,
    /// Of those, bytes written from the message itself, registered for the
    /// time (zero-copy send, wire-protocol-rdma §5.1), not from a staging
    /// buffer.
    rendezvous_zero_copy_bytes,
    /// Messages sent for the peer to read (RDV_READ, wire-protocol-rdma
    /// §5.6): their payload was neither copied nor written by us.
    reads_announced,
    /// Bytes RDMA-READ from the peer into buffers handed to the
    /// application as they are (wire-protocol-rdma §5.6).
    read_bytes,
    /// Of the messages read from the peer, those that got no buffer of
    /// their own (the registered-memory cap) and were read through the
    /// staging buffers and copied (wire-protocol-rdma §5.6).
    reads_staged,
    /// Bytes the peer RDMA-WROTE into destinations granted for its
    /// messages and handed to the application as they are
    /// (wire-protocol-rdma §5.7).
    dest_bytes,
    /// Explicit credit-return messages sent.
    credit_msgs,
    /// Completion-channel events consumed.
    cq_events,
    /// Of `cq_events`, those of connections a listener accepted (a
    /// server's side of its calls). Process-wide only, as below.
    cq_events_accepted,
    /// Keepalive probes queued on idle connections (wire-protocol-rdma §4.4).
    keepalives,
    /// Zero-length RDMA WRITEs the active side posted while waiting for the
    /// passive side's first message (wire-protocol-rdma §2.3 step 6).
    setup_kicks,
    /// Credit grants sent: a receive ring grew (wire-protocol-rdma §4.6).
    credit_grants,
    /// Credit revokes released by the peer: a grown receive ring went back
    /// to its initial size (wire-protocol-rdma §4.7).
    credit_revokes,
    /// Connections established.
    connections,
    /// Of those, connections whose receive buffers come from a listener's
    /// shared receive queue (wire-protocol-rdma §4.7).
    shared_receive_connections,
    /// Memory regions registered (`ibv_reg_mr` calls). Process-wide only
    /// ([`global_stats`](crate::global_stats)); 0 in a connection's stats.
    memory_registrations,
    /// Posted receive buffers a listener's shared receive queue took back
    /// by consuming them on its own loopback QP after connections closed
    /// (wire-protocol-rdma §4.7, "Shrinking"). Process-wide only, as above.
    receive_buffers_drained,
    /// Registered blocks a connection took from the process-wide pool of
    /// its device instead of registering new memory (buffer-ownership.md,
    /// "Process-wide block pool"). Process-wide only, as above.
    pool_reuses,
    /// Side queue pairs of one-sided access established, on either side
    /// (wire-protocol-rdma §10.2). Process-wide only, as above.
    side_queue_pairs,
    /// One-sided operations posted again on a fresh side queue pair after
    /// the one they were on failed under them (wire-protocol-rdma §10.3).
    /// Process-wide only, as above.
    one_sided_retries,
    /// One-sided READs of at most 4 KiB that landed in their side queue
    /// pair's own buffer and were copied out from there, taking no local
    /// buffer (wire-protocol-rdma §10.5). Process-wide only, as above.
    small_reads_in_place,
}

pub(crate) static GLOBAL: ConnStats = ConnStats::new_const();

impl ConnStats {
    /// Adds what the engine counted since `last` to this connection's
    /// counters and the process-wide ones (two relaxed adds per counter
    /// that moved, nothing for the others).
    pub(crate) fn add_delta(&self, now: &EngineCounters, last: &EngineCounters) {
        macro_rules! add {
            ($($stat:ident = $counted:ident),* $(,)?) => {$(
                let d = now.$counted - last.$counted;
                if d != 0 {
                    self.$stat.fetch_add(d, Relaxed);
                    GLOBAL.$stat.fetch_add(d, Relaxed);
                }
            )*};
        }
        add!(
            msgs_sent = msgs_sent,
            msgs_recv = msgs_recv,
            bytes_sent = bytes_sent,
            bytes_recv = bytes_recv,
            eager_sends = eager_sends,
            inline_sends = inline_sends,
            rendezvous_writes = rdv_writes,
            rendezvous_bytes = rdv_bytes,
            rendezvous_zero_copy_bytes = zero_copy_bytes,
            reads_announced = read_announced,
            read_bytes = read_bytes,
            reads_staged = reads_staged,
            dest_bytes = dest_bytes,
            credit_msgs = credit_msgs,
            credit_grants = credit_grants,
            credit_revokes = credit_revokes,
        );
    }

    pub(crate) fn bump(&self, f: impl Fn(&ConnStats) -> &AtomicU64, n: u64) {
        f(self).fetch_add(n, Relaxed);
        f(&GLOBAL).fetch_add(n, Relaxed);
    }
}
