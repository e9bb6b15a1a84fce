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
    pub(crate) fn add_delta(&self, now: &EngineCounters, last: &EngineCounters) {
        let pairs = [
            (
                &self.msgs_sent,
                &GLOBAL.msgs_sent,
                now.msgs_sent - last.msgs_sent,
            ),
            (
                &self.msgs_recv,
                &GLOBAL.msgs_recv,
                now.msgs_recv - last.msgs_recv,
            ),
            (
                &self.bytes_sent,
                &GLOBAL.bytes_sent,
                now.bytes_sent - last.bytes_sent,
            ),
            (
                &self.bytes_recv,
                &GLOBAL.bytes_recv,
                now.bytes_recv - last.bytes_recv,
            ),
            (
                &self.eager_sends,
                &GLOBAL.eager_sends,
                now.eager_sends - last.eager_sends,
            ),
            (
                &self.inline_sends,
                &GLOBAL.inline_sends,
                now.inline_sends - last.inline_sends,
            ),
            (
                &self.rendezvous_writes,
                &GLOBAL.rendezvous_writes,
                now.rdv_writes - last.rdv_writes,
            ),
            (
                &self.rendezvous_bytes,
                &GLOBAL.rendezvous_bytes,
                now.rdv_bytes - last.rdv_bytes,
            ),
            (
                &self.rendezvous_zero_copy_bytes,
                &GLOBAL.rendezvous_zero_copy_bytes,
                now.zero_copy_bytes - last.zero_copy_bytes,
            ),
            (
                &self.reads_announced,
                &GLOBAL.reads_announced,
                now.read_announced - last.read_announced,
            ),
            (
                &self.read_bytes,
                &GLOBAL.read_bytes,
                now.read_bytes - last.read_bytes,
            ),
            (
                &self.reads_staged,
                &GLOBAL.reads_staged,
                now.reads_staged - last.reads_staged,
            ),
            (
                &self.dest_bytes,
                &GLOBAL.dest_bytes,
                now.dest_bytes - last.dest_bytes,
            ),
            (
                &self.credit_msgs,
                &GLOBAL.credit_msgs,
                now.credit_msgs - last.credit_msgs,
            ),
            (
                &self.credit_grants,
                &GLOBAL.credit_grants,
                now.credit_grants - last.credit_grants,
            ),
            (
                &self.credit_revokes,
                &GLOBAL.credit_revokes,
                now.credit_revokes - last.credit_revokes,
            ),
        ];
        for (c, g, d) in pairs {
            if d != 0 {
                c.fetch_add(d, Relaxed);
                g.fetch_add(d, Relaxed);
            }
        }
    }

    pub(crate) fn bump(&self, f: impl Fn(&ConnStats) -> &AtomicU64, n: u64) {
        f(self).fetch_add(n, Relaxed);
        f(&GLOBAL).fetch_add(n, Relaxed);
    }
}
