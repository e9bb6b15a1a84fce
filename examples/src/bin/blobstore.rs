//! A blob store whose bytes move by remote memory (`rpc_core::remote`).
//!
//! `blobstore server` serves it; `blobstore client` stores a blob with `Put`
//! (the server reads it from the client's memory), reads it back with
//! `Get` (the client reads the server's memory one-sided) and with `Fetch`
//! (the server writes into the client's memory); `blobstore demo` (the
//! default) runs both in one process. Over RDMA the reads and writes are
//! one-sided RDMA READ and WRITE; over TCP the same calls go through the
//! server's remote-memory service.
use bytes::{Bytes, BytesMut};
use clap::{Parser, Subcommand};
use rpc_core::remote::{Access, Remote};
use rpc_core::{Channel, Server};
use rpc_examples::blobstore::Blobs;
use rpc_examples::pb::blobstore::blob_store_client::BlobStoreClient;
use rpc_examples::pb::blobstore::blob_store_server::BlobStoreServer;
use rpc_examples::pb::blobstore::{FetchRequest, GetRequest, PutRequest, ReleaseRequest};
use std::time::Instant;

#[derive(Parser)]
#[command(about = "Blob store over remote memory: one-sided RDMA where there is RDMA")]
struct Args {
    /// Address to serve on / connect to.
    #[arg(long, default_value = rpc_examples::DEFAULT_ADDR, global = true)]
    addr: std::net::SocketAddr,
    /// Blob size in bytes for the client.
    #[arg(long, default_value_t = 1 << 20, global = true)]
    size: usize,
    #[command(subcommand)]
    mode: Option<Mode>,
}

#[derive(Subcommand, Clone, Copy)]
enum Mode {
    /// Serve the blob store.
    Server,
    /// Put, Get and Fetch one blob against a running server.
    Client,
    /// Server and client in one process (the default).
    Demo,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    rpc_examples::init_tracing();
    let args = Args::parse();
    match args.mode.unwrap_or(Mode::Demo) {
        Mode::Server => {
            println!("BlobStore listening on {}", args.addr);
            Server::builder()
                .add_service(BlobStoreServer::new(Blobs::default()))
                .serve(args.addr)
                .await?;
        }
        Mode::Client => client(args.addr, args.size).await?,
        Mode::Demo => {
            let server = Server::builder()
                .add_service(BlobStoreServer::new(Blobs::default()))
                .start(args.addr)
                .await?;
            let addr = server.rdma_addr().unwrap_or(server.local_addr());
            let r = client(addr, args.size).await;
            server.shutdown().await?;
            r?;
        }
    }
    Ok(())
}

async fn client(addr: std::net::SocketAddr, size: usize) -> Result<(), Box<dyn std::error::Error>> {
    let channel = Channel::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    println!("transport: {}", channel.transport());
    let mut store = BlobStoreClient::new(channel.clone());
    let remote = Remote::of_channel(&channel).await?;
    println!(
        "remote memory: {}",
        if remote.is_one_sided() {
            "one-sided RDMA READ and WRITE"
        } else {
            "through the server's RemoteMemory service"
        }
    );
    let blob: Bytes = (0..size)
        .map(|i| (i % 251) as u8)
        .collect::<Vec<u8>>()
        .into();

    // Put: the server reads the blob from our memory.
    let t = Instant::now();
    let source = remote.expose(blob.clone(), Access::Read).await?;
    store
        .put(PutRequest {
            name: "blob".into(),
            source: Some(source.region()),
        })
        .await?;
    source.revoke().await?;
    println!(
        "put   {size} bytes: the server read them from ours ({:?})",
        t.elapsed()
    );

    // Get: we read the server's copy.
    let t = Instant::now();
    let got = store
        .get(GetRequest {
            name: "blob".into(),
        })
        .await?
        .into_inner();
    let region = got.blob.ok_or("Get answered no region")?;
    let bytes = remote.read(&region, 0, region.length).await?;
    store.release(ReleaseRequest { lease: got.lease }).await?;
    println!(
        "get   {} bytes: we read the server's ({:?})",
        bytes.len(),
        t.elapsed()
    );
    if bytes != blob {
        return Err("Get read other bytes than were put".into());
    }

    // Fetch: the server writes the blob into our memory.
    let t = Instant::now();
    let destination = remote.expose(BytesMut::zeroed(size), Access::Write).await?;
    store
        .fetch(FetchRequest {
            name: "blob".into(),
            destination: Some(destination.region()),
        })
        .await?;
    let written = destination.revoke().await?.into_bytes();
    println!(
        "fetch {} bytes: the server wrote them into ours ({:?})",
        written.len(),
        t.elapsed()
    );
    if written != blob {
        return Err("Fetch wrote other bytes than were put".into());
    }
    println!("ok");
    Ok(())
}
