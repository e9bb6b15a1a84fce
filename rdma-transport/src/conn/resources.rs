//! The verbs resources of a new connection: its CQs, QP and registered
//! memory, built before the handshake, with the initial receives posted
//! (§4.1) and our hello; the process-wide block pool of each device and a
//! listener's shared receive pools they draw from (§4.7); and the engine
//! configuration both sides' hellos give.

use std::sync::{Arc, Mutex, Weak};

use crate::config::Config;
use crate::engine::wire::{
    Hello, HELLO_FLAG_COVERS, HELLO_FLAG_ON_DEMAND, HELLO_FLAG_READ, HELLO_FLAG_REVOCABLE,
    HELLO_FLAG_WRITE_DEST, HELLO_FLAG_WRITE_IMM, VERSION,
};
use crate::engine::EngineConfig;
use crate::error::Error;
use crate::mem::{ConnMemory, DevicePool, PoolSizes, RecvPool};
use crate::verbs::cm::CmId;
use crate::verbs::{CompChannel, Cq, Pd, Qp, QpCaps};

/// Verbs resources of one connection before the driver starts.
pub(crate) struct Resources {
    pub(crate) mem: ConnMemory,
    /// Receive completions: the CQ the driver sleeps on.
    pub(crate) cq: Arc<Cq>,
    /// Send completions, on the same completion channel; armed only while
    /// the engine waits for one (§8), so they do not wake the driver.
    pub(crate) send_cq: Arc<Cq>,
    pub(crate) hello: Hello,
    /// The device is iWARP (no immediate data; a zero-length WRITE still
    /// needs a valid rkey there as far as we know, §4.4).
    pub(crate) iwarp: bool,
}

/// The process-wide block pools, one per device (buffer-ownership.md,
/// "Process-wide block pool"), keyed by device context (librdmacm opens
/// each device once per process): each is created by the first connection
/// on its device and goes with the last one (a `Weak` here). `None`: the
/// device has no memory windows, or its pool could not be created.
static DEVICE_POOLS: Mutex<Vec<(usize, Option<Weak<DevicePool>>)>> = Mutex::new(Vec::new());

/// The entry for `id`'s device in a per-device list (added, as "not created
/// yet", if missing): `None` means the device cannot have one.
fn device_entry<'a, T>(
    list: &'a mut Vec<(usize, Option<Weak<T>>)>,
    id: &CmId,
) -> &'a mut Option<Weak<T>> {
    let ctx = id.verbs() as usize;
    let i = match list.iter().position(|(c, _)| *c == ctx) {
        Some(i) => i,
        None => {
            list.push((ctx, Some(Weak::new())));
            list.len() - 1
        }
    };
    &mut list[i].1
}

/// The pool of `id`'s device, created if needed; `None` where connections
/// keep a PD of their own (`cfg`, iWARP, a device without windows).
fn device_pool(id: &Arc<CmId>, cfg: &Config) -> Option<Arc<DevicePool>> {
    if !cfg.device_pool || !cfg.memory_on_demand || id.is_iwarp() {
        return None;
    }
    let mut pools = DEVICE_POOLS.lock().unwrap_or_else(|p| p.into_inner());
    let entry = device_entry(&mut pools, id);
    if let Some(p) = entry.as_ref()?.upgrade() {
        return Some(p);
    }
    if !crate::verbs::window_support(id) {
        tracing::info!(
            "rdma: the device has no type-2 memory windows; every connection keeps a PD \
             and buffers of its own"
        );
        *entry = None;
        return None;
    }
    match Pd::new(id.clone()) {
        Ok(pd) => {
            let p = Arc::new(DevicePool::new(
                pd,
                cfg.global_max_registered_bytes,
                cfg.device_pool_idle_bytes,
                cfg.memory_idle_release,
            ));
            *entry = Some(Arc::downgrade(&p));
            Some(p)
        }
        Err(e) => {
            tracing::warn!("rdma: no device pool ({e}); this connection keeps a PD of its own");
            None
        }
    }
}

/// The shared receive pools of a listener, one per device (§4.7), in the
/// device pool's PD: each is created by the first connection accepted on
/// its device and goes with the last one (a `Weak` here).
#[derive(Default)]
pub(crate) struct SharedPools {
    /// (device context address, pool); `None`: the device has no SRQ, or
    /// its pool could not be created.
    pools: Mutex<Vec<(usize, Option<Weak<RecvPool>>)>>,
}

impl SharedPools {
    /// The pool for `id`'s device, created if needed; `None` where the
    /// device cannot share receive buffers (or `cfg` says not to).
    fn get(&self, id: &Arc<CmId>, cfg: &Config, dev: &DevicePool) -> Option<Arc<RecvPool>> {
        if !cfg.shared_receive_queue {
            return None;
        }
        let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        let entry = device_entry(&mut pools, id);
        if let Some(p) = entry.as_ref()?.upgrade() {
            return Some(p);
        }
        let Some(max_wr) = crate::verbs::shared_receive_support(id) else {
            tracing::info!(
                "rdma listener: the device has no shared receive queue; \
                 receive rings stay per connection"
            );
            *entry = None;
            return None;
        };
        let max = (cfg.shared_receive_max_buffers as usize).min(max_wr as usize);
        match RecvPool::new(
            id,
            dev.pd().clone(),
            cfg.recv_slot_bytes,
            max,
            cfg.global_max_registered_bytes,
        ) {
            Ok(p) => {
                let p = Arc::new(p);
                *entry = Some(Arc::downgrade(&p));
                Some(p)
            }
            Err(e) => {
                tracing::warn!("rdma listener: no shared receive queue ({e}); receive rings stay per connection");
                None
            }
        }
    }
}

pub(super) fn build_resources(
    id: &Arc<CmId>,
    cfg: &Config,
    shared: Option<&SharedPools>,
) -> Result<Resources, Error> {
    let dev = device_pool(id, cfg);
    let pool = shared
        .zip(dev.as_ref())
        .and_then(|(s, d)| s.get(id, cfg, d));
    let comp = CompChannel::new(id.clone())?;
    // One more work request on the send queue with a shared pool: the
    // signaled bind of the rendezvous region's window (§4.7).
    let sq_depth = cfg.send_slots + cfg.rendezvous_buffers + 1 + u32::from(pool.is_some());
    // §8: receive and send completions on CQs of their own, one channel,
    // so that send completions need not wake the driver. Not on iWARP:
    // siw (Linux 6.1) then failed to set up connections made at the same
    // time (`ibv_create_cq` EAGAIN, `rdma_create_qp` EINVAL in
    // verbs::eight_connections_concurrently); there one CQ takes both, as
    // before, and every completion wakes the driver.
    let (cq, send_cq) = if id.is_iwarp() {
        let cq = Cq::new(id, comp, (sq_depth + cfg.recv_slots + 16) as i32)?;
        (cq.clone(), cq)
    } else {
        let cq = Cq::new(id, comp.clone(), (cfg.recv_slots + 16) as i32)?;
        (cq, Cq::new(id, comp, (sq_depth + 16) as i32)?)
    };
    let sizes = PoolSizes {
        recv_slots: cfg.recv_slots as usize,
        recv_slot_bytes: cfg.recv_slot_bytes,
        send_slots: cfg.send_slots as usize,
        send_slot_bytes: cfg.recv_slot_bytes,
        rdv_count: cfg.rendezvous_buffers as usize,
        rdv_bytes: cfg.rendezvous_buffer_bytes,
        recv_seg: cfg.recv_slots_at_start() as usize,
        send_seg: cfg.send_slots_at_start() as usize,
    };
    let shared_mem = pool.zip(dev.clone()).and_then(|(pool, dev)| {
        let srq = pool.srq().clone();
        match ConnMemory::new_shared(
            dev,
            pool,
            cq.clone(),
            sizes,
            cfg.global_max_registered_bytes,
            cfg.recv_slots_at_start() as usize,
            cfg.send_slots_at_start() as usize,
        ) {
            Ok(m) => Some((m, srq)),
            Err(e) => {
                // A full pool (shared_receive_max_buffers): this
                // connection gets a ring of its own.
                tracing::info!("rdma listener: {e}; this connection gets its own receive ring");
                None
            }
        }
    });
    let (mut mem, pd, srq) = match shared_mem {
        Some((m, srq)) => {
            let pd = m.pd().clone();
            (m, pd, Some(srq))
        }
        None => {
            let pd = match &dev {
                Some(d) => d.pd().clone(),
                None => Pd::new(id.clone())?,
            };
            let m = ConnMemory::new(
                &pd,
                dev,
                sizes,
                cfg.global_max_registered_bytes,
                cfg.recv_slots_at_start() as usize,
                cfg.send_slots_at_start() as usize,
                !cfg.memory_on_demand,
            )?;
            (m, pd, None)
        }
    };
    let qp = Qp::new(
        id.clone(),
        pd,
        send_cq.clone(),
        cq.clone(),
        QpCaps {
            send_wr: sq_depth,
            recv_wr: cfg.recv_slots,
            inline: cfg.max_inline_bytes,
            srq,
        },
    )?;
    mem.attach_qp(qp);
    // §4.1: every receive slot is posted before connect/accept, so the peer
    // may use all its initial credits as soon as the connection is up.
    let initial: Vec<_> = (0..cfg.recv_slots_at_start())
        .map(|slot| crate::engine::Action::PostRecv {
            slot,
            wr_id: crate::engine::recv_wr_id(slot, 0),
        })
        .collect();
    mem.execute(&initial)?;
    // §5.4: offer chunk notification by WRITE with immediate data where the
    // device has it (not on iWARP), and covering notifications everywhere.
    let mut flags = if cfg.write_with_imm && !id.is_iwarp() {
        HELLO_FLAG_WRITE_IMM | HELLO_FLAG_COVERS
    } else {
        HELLO_FLAG_COVERS
    };
    if cfg.memory_on_demand {
        // §4.7: and we answer a peer's credit revoke.
        flags |= HELLO_FLAG_ON_DEMAND | HELLO_FLAG_REVOCABLE;
    }
    if cfg.read_rendezvous {
        // §5.6: we read the peer's large messages, and offer ours.
        flags |= HELLO_FLAG_READ;
        if cfg.write_destination {
            // §5.7: we WRITE a body the peer grants a destination for,
            // and grant ours where a window can scope one to this peer.
            flags |= HELLO_FLAG_WRITE_DEST;
        }
    }
    mem.set_read_cache_bytes(cfg.read_cache_bytes);
    let hello = Hello {
        version: VERSION,
        flags,
        credits: cfg.recv_slots_at_start(),
        recv_slot_bytes: cfg.recv_slot_bytes as u32,
        rdv_count: cfg.rendezvous_buffers,
        rdv_bytes: cfg.rendezvous_buffer_bytes as u32,
        rdv_addr: mem.rdv_addr(),
        rdv_rkey: mem.rdv_rkey(),
        max_message: cfg.max_message_bytes as u64,
    };
    Ok(Resources {
        cq,
        send_cq,
        mem,
        hello,
        iwarp: id.is_iwarp(),
    })
}

pub(super) fn engine_config(cfg: &Config, res: &Resources, peer: Hello) -> EngineConfig {
    let max_inline = res.mem.qp().map(|q| q.max_inline).unwrap_or(0) as usize;
    EngineConfig {
        recv_slots: cfg.recv_slots,
        initial_recv_slots: cfg.recv_slots_at_start(),
        recv_slot_bytes: cfg.recv_slot_bytes,
        send_slots: cfg.send_slots,
        initial_send_slots: cfg.send_slots_at_start(),
        on_demand: cfg.memory_on_demand,
        send_slot_bytes: cfg.recv_slot_bytes,
        rendezvous_threshold: cfg.rendezvous_threshold_bytes,
        rdv_count: cfg.rendezvous_buffers,
        rdv_bytes: cfg.rendezvous_buffer_bytes,
        rdv_addr: res.mem.rdv_addr(),
        staging_count: cfg.rendezvous_buffers,
        staging_bytes: cfg.rendezvous_buffer_bytes,
        zero_copy_min: cfg.zero_copy_send_bytes,
        max_message: cfg.max_message_bytes,
        signal_every: cfg.signal_every_eff(),
        max_inline,
        write_imm: res.hello.flags & peer.flags & HELLO_FLAG_WRITE_IMM != 0,
        covers: res.hello.flags & peer.flags & HELLO_FLAG_COVERS != 0,
        read_rdv: res.hello.flags & peer.flags & HELLO_FLAG_READ != 0,
        write_dest: write_dest(res.hello.flags, peer.flags),
        // §5.7: a destination is granted through a type-2 window bound to
        // our QP (a device's shared PD); siw has none: it reads.
        grant_dest: write_dest(res.hello.flags, peer.flags)
            && res.mem.grants_windows()
            && !res.iwarp,
        zero_length_write_any_rkey: !res.iwarp,
        // §4.7: only a shared receive queue can take receives back.
        revoke_idle: res.mem.is_shared(),
        peer,
    }
}

/// Both hellos offered reading and written destinations (§2.1, §5.7).
fn write_dest(ours: u16, peer: u16) -> bool {
    let both = HELLO_FLAG_READ | HELLO_FLAG_WRITE_DEST;
    ours & peer & both == both
}
