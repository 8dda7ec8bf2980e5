//! `faultline-kube-emulator`: runs the Kubernetes API server emulator by hand.
//!
//! ```text
//! faultline-kube-emulator --listen 127.0.0.1:8001 --kubeconfig /tmp/emulator.kubeconfig \
//!     --token dev --node gpu-1 --node gpu-2 --namespace faultline
//! KUBECONFIG=/tmp/emulator.kubeconfig kubectl get nodes
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;
use faultline_kube_emulator::{namespace, node, Emulator};
use tracing_subscriber::EnvFilter;

/// Kubernetes API server emulator for faultline tests.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Address to serve plain HTTP on.
    #[arg(long, default_value = "127.0.0.1:8001")]
    listen: SocketAddr,
    /// Where to write a kubeconfig pointing at the emulator.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// Bearer token written into the kubeconfig.
    #[arg(long, default_value = "dev")]
    token: String,
    /// Nodes to create (repeatable).
    #[arg(long = "node")]
    nodes: Vec<String>,
    /// Extra namespaces to create (repeatable).
    #[arg(long = "namespace")]
    namespaces: Vec<String>,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    let emu = Emulator::start_on(args.listen).await?;
    for ns in &args.namespaces {
        emu.put(namespace(ns));
    }
    for n in &args.nodes {
        emu.put(node(n, &[]));
    }
    if let Some(path) = &args.kubeconfig {
        emu.write_kubeconfig(path, &args.token)?;
        tracing::info!(path = %path.display(), "wrote kubeconfig");
    }
    tracing::info!(url = %emu.url(), "kube emulator serving; ctrl-c to stop");
    tokio::signal::ctrl_c().await?;
    tracing::info!("shutting down");
    emu.down().await;
    Ok(())
}
