//! tonic's route guide server over rpc-core.
use clap::Parser;
use rpc_core::Server;
use rpc_examples::pb::routeguide::route_guide_server::RouteGuideServer;
use rpc_examples::routeguide::{load_db, RouteGuideService, BUNDLED_DB};
use std::sync::Arc;

#[derive(Parser)]
#[command(about = "Route guide server: RDMA (when available) and HTTP/2 on TCP, same port")]
struct Args {
    /// Address to serve on.
    #[arg(long, default_value = rpc_examples::DEFAULT_ADDR)]
    addr: std::net::SocketAddr,
    /// Feature database in gRPC's route_guide_db.json format (default: the bundled one).
    #[arg(long)]
    db: Option<std::path::PathBuf>,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    rpc_examples::init_tracing();
    let args = Args::parse();
    let json = match &args.db {
        Some(p) => {
            std::fs::read_to_string(p).map_err(|e| format!("reading {}: {e}", p.display()))?
        }
        None => BUNDLED_DB.to_string(),
    };
    let features = load_db(&json).map_err(|e| format!("parsing the feature database: {e}"))?;
    println!(
        "RouteGuideServer listening on {} ({} features)",
        args.addr,
        features.len()
    );

    let route_guide = RouteGuideService {
        features: Arc::new(features),
    };

    let svc = RouteGuideServer::new(route_guide);

    Server::builder()
        .add_service(svc)
        .serve_with_shutdown(args.addr, async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;

    Ok(())
}
