//! Ping-pong latency + streaming bandwidth over `rdma-transport`, in the
//! spirit of `ibv_rc_pingpong` / `rping`.
//!
//! ```text
//! rdma_pingpong --server 192.168.77.1:7471 [opts]     # one process
//! rdma_pingpong --client 192.168.77.1:7471 [opts]     # another process
//! rdma_pingpong --loopback 192.168.77.1 [opts]        # both ends in one process
//! opts: --size BYTES (ping size, default 64) --iters N (default 1000)
//!       --bw-size BYTES (default 1 MiB) --bw-iters N (default 32; 0 = no bandwidth phase)
//!       --runtime multi|current (tokio runtime, default multi: one worker per core)
//!       --busy-poll-us N (Config::busy_poll, default: Config's)
//!       --poll-mode adaptive|fixed|spin (Config::poll_mode, default adaptive)
//!       --deliver task|inline (default task: each end awaits `RecvHalf::recv`
//!         in its task; inline: each end answers from `RecvHalf::deliver_inline`'s
//!         handler, on the connection's driver, with no task in between, as
//!         rpc-core does; latency phase only)
//! ```
//! The client prints one parseable line for the latency phase (times in µs):
//! `PINGPONG runtime=multi size=64 iters=1000 busy_poll_us=20 p50_us=.. p99_us=.. avg_us=.. min_us=..`
//! In the Soft-RoCE VM (`$SOFTROCE_IP`):
//! `run-in-softroce-vm.sh sh -c 'timeout 120 ./target/debug/examples/rdma_pingpong --loopback $SOFTROCE_IP'`

use std::net::{IpAddr, SocketAddr};
use std::time::Instant;

use bytes::Bytes;
use rdma_transport::{connect, global_stats, Config, Connection, Error, Listener};

struct Opts {
    size: usize,
    iters: usize,
    bw_size: usize,
    bw_iters: usize,
    /// Only for the report line.
    runtime: &'static str,
    busy_poll_us: u128,
    /// Answer from the inline handler (`--deliver inline`).
    inline: bool,
}

async fn server(conn: Connection, o: &Opts) -> Result<(), Error> {
    if o.inline {
        return inline::server(conn, o.iters).await;
    }
    let (mut tx, mut rx) = conn.split();
    for _ in 0..o.iters {
        let m = rx.recv().await?.ok_or(Error::Disconnected)?;
        tx.send(m).await?;
    }
    if o.bw_iters == 0 {
        tx.close().await;
        let _ = rx.recv().await;
        return Ok(());
    }
    let mut bytes = 0;
    for _ in 0..o.bw_iters {
        bytes += rx.recv().await?.ok_or(Error::Disconnected)?.len();
    }
    tx.send(Bytes::from((bytes as u64).to_le_bytes().to_vec()))
        .await?;
    tx.close().await;
    let _ = rx.recv().await;
    Ok(())
}

async fn client(conn: Connection, o: &Opts) -> Result<(), Error> {
    let peer = conn.peer_addr();
    let stats = conn.stats();
    let (mut tx, mut rx) = conn.split();
    let ping = Bytes::from(vec![0xabu8; o.size]);
    if o.inline {
        let mut lat = inline::client(tx, rx, ping, o.iters).await?;
        lat.sort();
        report(peer, o, &lat);
        println!("connection stats: {:?}", stats.snapshot());
        return Ok(());
    }
    let mut lat = Vec::with_capacity(o.iters);
    for _ in 0..o.iters {
        let t = Instant::now();
        tx.send(ping.clone()).await?;
        let m = rx.recv().await?.ok_or(Error::Disconnected)?;
        lat.push(t.elapsed());
        assert_eq!(m.len(), o.size);
    }
    lat.sort();
    report(peer, o, &lat);
    if o.bw_iters == 0 {
        tx.close().await;
        let _ = rx.recv().await;
        println!("connection stats: {:?}", stats.snapshot());
        return Ok(());
    }
    let msg = Bytes::from(vec![0x5au8; o.bw_size]);
    let t = Instant::now();
    for _ in 0..o.bw_iters {
        tx.send(msg.clone()).await?;
    }
    let ack = rx.recv().await?.ok_or(Error::Disconnected)?;
    let el = t.elapsed();
    let got = u64::from_le_bytes(ack[..8].try_into().unwrap());
    assert_eq!(got as usize, o.bw_size * o.bw_iters);
    println!(
        "bandwidth: {} x {} B in {:?} = {:.2} MB/s",
        o.bw_iters,
        o.bw_size,
        el,
        got as f64 / el.as_secs_f64() / 1e6
    );
    tx.close().await;
    let _ = rx.recv().await;
    println!("connection stats: {:?}", stats.snapshot());
    println!("global stats:     {:?}", global_stats());
    Ok(())
}

/// Prints the latency phase's figures (`lat` sorted).
fn report(peer: SocketAddr, o: &Opts, lat: &[std::time::Duration]) {
    let avg = lat.iter().sum::<std::time::Duration>() / lat.len().max(1) as u32;
    if !lat.is_empty() {
        println!(
            "peer {peer}: {} pings of {} B: RTT avg {:?}, p50 {:?}, p99 {:?}, min {:?} (one-way ~{:?})",
            o.iters,
            o.size,
            avg,
            lat[lat.len() / 2],
            lat[lat.len() * 99 / 100],
            lat[0],
            avg / 2
        );
        let us = |d: std::time::Duration| d.as_secs_f64() * 1e6;
        println!(
            "PINGPONG runtime={} deliver={} size={} iters={} busy_poll_us={} p50_us={:.1} p99_us={:.1} avg_us={:.1} min_us={:.1}",
            o.runtime,
            if o.inline { "inline" } else { "task" },
            o.size,
            o.iters,
            o.busy_poll_us,
            us(lat[lat.len() / 2]),
            us(lat[lat.len() * 99 / 100]),
            us(avg),
            us(lat[0])
        );
    }
}

fn usage() -> ! {
    eprintln!(
        "usage: rdma_pingpong (--server ADDR:PORT | --client ADDR:PORT | --loopback IP) \
         [--size B] [--iters N] [--bw-size B] [--bw-iters N] [--runtime multi|current] \
         [--busy-poll-us N] [--poll-mode adaptive|fixed|spin] [--deliver task|inline]"
    );
    std::process::exit(2)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut mode = None;
    let mut cfg = Config::default();
    let mut o = Opts {
        size: 64,
        iters: 1000,
        bw_size: 1 << 20,
        bw_iters: 32,
        runtime: "multi",
        busy_poll_us: cfg.busy_poll.as_micros(),
        inline: false,
    };
    let mut i = 0;
    while i < args.len() {
        let v = args.get(i + 1).cloned().unwrap_or_else(|| usage());
        match args[i].as_str() {
            "--server" | "--client" | "--loopback" => mode = Some((args[i].clone(), v)),
            "--size" => o.size = v.parse().unwrap_or_else(|_| usage()),
            "--iters" => o.iters = v.parse().unwrap_or_else(|_| usage()),
            "--bw-size" => o.bw_size = v.parse().unwrap_or_else(|_| usage()),
            "--bw-iters" => o.bw_iters = v.parse().unwrap_or_else(|_| usage()),
            "--runtime" => {
                o.runtime = match v.as_str() {
                    "multi" => "multi",
                    "current" => "current",
                    _ => usage(),
                }
            }
            "--busy-poll-us" => {
                let us: u64 = v.parse().unwrap_or_else(|_| usage());
                cfg.busy_poll = std::time::Duration::from_micros(us);
                o.busy_poll_us = us.into();
            }
            "--deliver" => {
                o.inline = match v.as_str() {
                    "task" => false,
                    "inline" => true,
                    _ => usage(),
                }
            }
            "--poll-mode" => {
                cfg.poll_mode = match v.as_str() {
                    "adaptive" => rdma_transport::PollMode::Adaptive,
                    "fixed" => rdma_transport::PollMode::Fixed,
                    "spin" => rdma_transport::PollMode::Spin,
                    _ => usage(),
                }
            }
            _ => usage(),
        }
        i += 2;
    }
    let mut rt = if o.runtime == "current" {
        tokio::runtime::Builder::new_current_thread()
    } else {
        tokio::runtime::Builder::new_multi_thread()
    };
    let rt = rt.enable_all().build().expect("tokio runtime");
    rt.block_on(run(mode, cfg, o));
}

async fn run(mode: Option<(String, String)>, cfg: Config, o: Opts) {
    println!("devices: {:?}", rdma_transport::devices());
    let r = match mode {
        Some((m, a)) if m == "--server" => {
            let addr: SocketAddr = a.parse().unwrap_or_else(|_| usage());
            match Listener::bind(addr, cfg.clone()).await {
                Ok(mut l) => {
                    println!("listening on {}", l.local_addr());
                    match l.accept().await {
                        Ok(c) => server(c, &o).await,
                        Err(e) => Err(e),
                    }
                }
                Err(e) => Err(e),
            }
        }
        Some((m, a)) if m == "--client" => {
            let addr: SocketAddr = a.parse().unwrap_or_else(|_| usage());
            match connect(addr, &cfg).await {
                Ok(c) => client(c, &o).await,
                Err(e) => Err(e),
            }
        }
        Some((_, a)) => {
            let ip: IpAddr = a.parse().unwrap_or_else(|_| usage());
            loopback(ip, cfg, o).await
        }
        None => usage(),
    };
    if let Err(e) = r {
        eprintln!(
            "error: {e} (RDMA unavailable, TCP fallback would apply: {})",
            e.is_unavailable_for_fallback()
        );
        std::process::exit(1);
    }
}

async fn loopback(ip: IpAddr, cfg: Config, o: Opts) -> Result<(), Error> {
    let mut l = Listener::bind(SocketAddr::new(ip, 0), cfg.clone()).await?;
    let addr = l.local_addr();
    println!("loopback via {addr}");
    let o = std::sync::Arc::new(o);
    let o2 = o.clone();
    let srv = tokio::spawn(async move {
        let c = l.accept().await?;
        server(c, &o2).await
    });
    let c = connect(addr, &cfg).await?;
    client(c, &o).await?;
    srv.await.expect("server task")
}

/// `--deliver inline`: both ends answer from the inline handler, on the
/// connection's driver (`RecvHalf::deliver_inline`), posting with
/// `SendHalf::try_send_parts`; a send the connection is not quiet enough
/// for goes through a task instead (one message is in flight at a time, so
/// nothing overtakes it).
mod inline {
    use super::*;
    use rdma_transport::SendHalf;
    use std::sync::{Arc, Mutex};
    use tokio::sync::oneshot;

    type Tx = Arc<tokio::sync::Mutex<SendHalf>>;

    /// Sends `m` from the handler: posted at once when the connection takes
    /// it, else by a task.
    fn send(tx: &Tx, m: Bytes) -> Result<(), Error> {
        let m = match tx.try_lock() {
            Ok(mut g) => match g.try_send_parts(Bytes::new(), m) {
                Ok(r) => return r,
                Err((_, m)) => m,
            },
            Err(_) => m,
        };
        let tx = tx.clone();
        tokio::spawn(async move { tx.lock().await.send(m).await });
        Ok(())
    }

    pub(super) async fn server(conn: Connection, iters: usize) -> Result<(), Error> {
        let (tx, rx) = conn.split();
        let tx: Tx = Arc::new(tokio::sync::Mutex::new(tx));
        let (done_tx, done_rx) = oneshot::channel::<Result<(), Error>>();
        let mut done = Some(done_tx);
        let mut n = 0;
        let t = tx.clone();
        let _stop = rx.deliver_inline(Box::new(move |r| {
            let r = match r {
                Ok(Some(m)) if n < iters => {
                    n += 1;
                    match send(&t, m) {
                        Ok(()) if n < iters => return true,
                        other => other,
                    }
                }
                Ok(_) => Ok(()),
                Err(e) => Err(e),
            };
            if let Some(d) = done.take() {
                let _ = d.send(r);
            }
            false
        }));
        let r = done_rx.await.unwrap_or(Err(Error::Disconnected));
        tx.lock().await.close().await;
        r
    }

    pub(super) async fn client(
        tx: SendHalf,
        rx: rdma_transport::RecvHalf,
        ping: Bytes,
        iters: usize,
    ) -> Result<Vec<std::time::Duration>, Error> {
        let tx: Tx = Arc::new(tokio::sync::Mutex::new(tx));
        let lat = Arc::new(Mutex::new(Vec::with_capacity(iters)));
        let (done_tx, done_rx) = oneshot::channel::<Result<(), Error>>();
        let mut done = Some(done_tx);
        let (t, l, p) = (tx.clone(), lat.clone(), ping.clone());
        let mut sent_at = Instant::now();
        let size = ping.len();
        // The handler is installed before the first ping leaves, so the
        // first pong finds it.
        let _stop = rx.deliver_inline(Box::new(move |r| {
            let r = match r {
                Ok(Some(m)) => {
                    let now = Instant::now();
                    let mut l = l.lock().unwrap_or_else(|e| e.into_inner());
                    l.push(now - sent_at);
                    if m.len() != size {
                        Err(Error::Disconnected)
                    } else if l.len() < iters {
                        drop(l);
                        sent_at = Instant::now();
                        match send(&t, p.clone()) {
                            Ok(()) => return true,
                            e => e,
                        }
                    } else {
                        Ok(())
                    }
                }
                Ok(None) => Err(Error::Disconnected),
                Err(e) => Err(e),
            };
            if let Some(d) = done.take() {
                let _ = d.send(r);
            }
            false
        }));
        if iters > 0 {
            // The first ping leaves from here; its round trip, timed from
            // the handler's creation above, also counts the lock and the
            // post (one sample of `iters`).
            tx.lock().await.send(ping).await?;
            done_rx.await.unwrap_or(Err(Error::Disconnected))?;
        }
        tx.lock().await.close().await;
        let lat = std::mem::take(&mut *lat.lock().unwrap_or_else(|e| e.into_inner()));
        if lat.len() != iters {
            eprintln!("error: {} of {iters} pongs arrived", lat.len());
            return Err(Error::Disconnected);
        }
        Ok(lat)
    }
}
