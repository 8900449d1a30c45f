//! `kube-cluster DIR`: the suite's real Kubernetes API server (etcd and kube-apiserver with
//! kvepp's CRDs established; see `kvepp_test_support::kube_cluster`) for benchmarks and for trying
//! things by hand. Writes the admin kubeconfig into DIR, prints `KUBECONFIG=<path>` once the
//! server is ready and runs until its standard input closes; etcd and the API server stop with it.
// A tool of the tests: a cluster that cannot start is a failed run, said by the panic's message.
#![allow(clippy::expect_used)]

use std::io::Read;
use std::path::PathBuf;

use kvepp_test_support::kube_cluster::KubeCluster;

#[tokio::main]
async fn main() {
    let dir = PathBuf::from(
        std::env::args_os()
            .nth(1)
            .expect("usage: kube-cluster DIR (where the kubeconfig goes)"),
    );
    std::fs::create_dir_all(&dir).expect("create the kubeconfig's directory");
    let cluster = KubeCluster::start().await;
    println!("KUBECONFIG={}", cluster.kubeconfig(&dir).display());
    let _ = tokio::task::spawn_blocking(|| std::io::stdin().read_to_end(&mut Vec::new())).await;
    drop(cluster);
}
