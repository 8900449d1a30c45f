//! The EndpointSlice watch against the real API server: churn, restarts, 410 Gone after an etcd
//! compaction, bookmarks, a large pool.

use super::*;

/// The watch's list, readiness flips, a pod in two slices, terminating endpoints; the API server
/// killed and restarted under the watch (changes after it arrive once, no relist); then history
/// compacted in etcd while kvepp's resourceVersion is behind it: the API server (watch cache off,
/// so etcd answers) says 410 Gone, kvepp relists and only the real differences come out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpointslice_watch_follows_readiness_restarts_and_410() {
    let mut cluster = KubeCluster::start_with(Options { watch_cache: false }).await;
    let dir = TempDir::new("kube");
    cluster
        .put(SLICES, pool_slice("pool-a", &[(1, true), (2, false)]))
        .await;
    cluster
        .put(
            SLICES,
            slice("other-x", "other", 8000, None, &[(&ip(9), "pod-9", true)]),
        )
        .await;
    let (disc, metrics) = discovery(&cluster, dir.path()).await;

    // Initial list: the ready pod of this Service only, then Synced.
    let mut w = disc.watch("default", "pool");
    let first = next(&mut w).await;
    let InstanceEvent::Added(p1) = &first else {
        panic!("{first:?}")
    };
    assert_eq!(
        (&*p1.id, p1.ip, p1.port, p1.metadata_port),
        ("pod-1", pod_ip(1), Some(8000), Some(8090))
    );
    assert_eq!(
        (p1.zone.as_deref(), p1.node.as_deref()),
        (Some("zone-a"), Some("node-1"))
    );
    assert_eq!(next(&mut w).await, InstanceEvent::Synced);
    assert_eq!(listed(&disc).await, set(&["pod-1"]));

    // Readiness flips are Added / Removed.
    cluster
        .put(SLICES, pool_slice("pool-a", &[(1, true), (2, true)]))
        .await;
    assert_eq!(added(&next(&mut w).await), Some("pod-2"));
    cluster
        .put(SLICES, pool_slice("pool-a", &[(1, false), (2, true)]))
        .await;
    assert_eq!(next(&mut w).await, InstanceEvent::Removed("pod-1".into()));

    // A pod in two slices is one instance.
    cluster
        .put(SLICES, pool_slice("pool-b", &[(2, true), (3, true)]))
        .await;
    assert_eq!(added(&next(&mut w).await), Some("pod-3"));
    cluster.delete(SLICES, "pool-a").await;
    cluster
        .put(SLICES, pool_slice("pool-c", &[(4, true)]))
        .await;
    assert!(
        until_added(&mut w, "pod-4").await.is_empty(),
        "slice deletion kept pod-2 (still in pool-b)"
    );
    // Terminating endpoints take no new work.
    let mut term = pool_slice("pool-c", &[(4, true)]);
    term["endpoints"][0]["conditions"]["terminating"] = true.into();
    cluster.put(SLICES, term).await;
    assert_eq!(next(&mut w).await, InstanceEvent::Removed("pod-4".into()));

    // The API server dies under the watch and comes back: the watch resumes from its
    // resourceVersion (etcd still has it) and changes made after arrive once, without a relist.
    let lists = relists(&metrics);
    cluster.restart_apiserver().await;
    cluster
        .put(SLICES, pool_slice("pool-c", &[(4, true), (5, true)]))
        .await;
    let before = until_added(&mut w, "pod-5").await;
    assert_eq!(
        ids(&before),
        ["+pod-4"],
        "pod-4 is ready again; nothing else changed"
    );
    assert_eq!(
        relists(&metrics),
        lists,
        "a resumable watch does not relist"
    );

    // Other objects move etcd's revision past kvepp's, history is compacted, and the API server
    // restarts: kvepp's resourceVersion is gone (410 Gone), it relists, and the state it reports
    // after is exactly the cluster's: pod-3 removed once, pod-6 added, nothing duplicated.
    for i in 0..5 {
        cluster
            .put(
                SLICES,
                slice(
                    "other-x",
                    "other",
                    8000 + i,
                    None,
                    &[(&ip(9), "pod-9", true)],
                ),
            )
            .await;
    }
    let compacted = cluster.compact().await;
    cluster.restart_apiserver().await;
    cluster
        .put(
            SLICES,
            pool_slice("pool-b", &[(2, true), (3, false), (6, true)]),
        )
        .await;
    let before = until_added(&mut w, "pod-6").await;
    assert_eq!(ids(&before), ["-pod-3"]);
    assert!(
        relists(&metrics) > lists,
        "the 410 after compaction at revision {compacted} forced a relist"
    );
    let now = listed(&disc).await;
    assert_eq!(
        now,
        ["pod-2", "pod-4", "pod-5", "pod-6"]
            .map(String::from)
            .into()
    );
}

/// The API server's count of watch events sent on EndpointSlice watches.
async fn slice_watch_events(cluster: &KubeCluster) -> f64 {
    let text = cluster.metrics_text().await;
    text.lines()
        .filter(|l| {
            l.starts_with("apiserver_watch_events_total{")
                && l.contains("group=\"discovery.k8s.io\"")
                && l.contains("resource=\"endpointslices\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Bookmarks, with the API server's watch cache on (as in every cluster): kvepp's watch asks for
/// them, the API server sends one about a minute into a quiet watch (seen in its own count of
/// events sent on EndpointSlice watches while no pool slice changed), and kvepp absorbs it: no
/// event, no relist, and the next change arrives as usual. After a restart of the API server
/// (whose new watch cache starts at etcd's current revision: kvepp resumes, or relists when that
/// is past its resourceVersion) what kvepp reports is the cluster's state with nothing duplicated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bookmarks_are_absorbed_and_a_restart_relists_cleanly() {
    let mut cluster = KubeCluster::start().await;
    let dir = TempDir::new("kube-bookmarks");
    cluster
        .put(SLICES, pool_slice("pool-a", &[(1, true)]))
        .await;
    let (disc, metrics) = discovery(&cluster, dir.path()).await;
    let mut w = disc.watch("default", "pool");
    assert_eq!(added(&next(&mut w).await), Some("pod-1"));
    assert_eq!(next(&mut w).await, InstanceEvent::Synced);
    for port in 8000..8005 {
        let other = slice("other-x", "other", port, None, &[(&ip(9), "pod-9", true)]);
        cluster.put(SLICES, other).await;
    }
    let sent = slice_watch_events(&cluster).await;
    let lists = relists(&metrics);
    let t = Instant::now();
    kvepp_test_support::wait_until(
        "a bookmark on kvepp's EndpointSlice watch",
        Duration::from_secs(120),
        || async { (slice_watch_events(&cluster).await > sent).then_some(()) },
    )
    .await
    .unwrap();
    eprintln!("bookmark after {:?}", t.elapsed());
    assert_eq!(
        futures::FutureExt::now_or_never(w.next()),
        None,
        "a bookmark is no event"
    );
    cluster
        .put(SLICES, pool_slice("pool-a", &[(1, true), (2, true)]))
        .await;
    assert_eq!(added(&next(&mut w).await), Some("pod-2"));
    assert_eq!(relists(&metrics), lists, "a bookmark is no relist");

    cluster.restart_apiserver().await;
    cluster
        .put(
            SLICES,
            pool_slice("pool-a", &[(1, true), (2, true), (3, true)]),
        )
        .await;
    assert!(
        until_added(&mut w, "pod-3").await.is_empty(),
        "nothing duplicated"
    );
    let now = listed(&disc).await;
    assert_eq!(now, set(&["pod-1", "pod-2", "pod-3"]));
}

/// A pool of 1,000 endpoints in 10 slices (100 each, as the endpoints controller batches them),
/// discovered by a starting kvepp within the stated time.
#[test]
fn a_pool_of_a_thousand_endpoints_is_discovered() {
    in_pod_network!(a_pool_of_a_thousand_endpoints_is_discovered, large_pool);
}

async fn large_pool() {
    let cluster = KubeCluster::start().await;
    cluster.put(POOLS_V1, pool_v1("pool", 8000)).await;
    for s in 0..10 {
        let eps: Vec<(String, String, bool)> = (0..100)
            .map(|i| {
                let n = s * 100 + i;
                (ip(n), format!("pod-{n}"), true)
            })
            .collect();
        let eps: Vec<(&str, &str, bool)> = eps.iter().map(|(a, p, r)| (&**a, &**p, *r)).collect();
        cluster
            .put(
                SLICES,
                slice(&format!("pool-{s}"), "pool", 8000, None, &eps),
            )
            .await;
    }
    let dir = TempDir::new("kube-large");
    let kubeconfig = cluster.kubeconfig(dir.path());
    let t = Instant::now();
    let epp = Epp::start_unready("", |c| {
        c.manifests_dir = None;
        c.kubeconfig = Some(kubeconfig);
        c.engine_metrics.enabled = false;
    })
    .await;
    kvepp_test_support::wait_until("1,000 endpoints ready", LARGE_POOL_DEADLINE, || async {
        (epp.metric("kvepp_ready_endpoints").await == Some(1000.0)).then_some(())
    })
    .await
    .unwrap();
    eprintln!(
        "1,000 endpoints in 10 slices discovered in {:?}",
        t.elapsed()
    );
    // One slice's endpoints all turn unready: exactly those leave.
    let eps: Vec<(String, String, bool)> = (0..100)
        .map(|n| (ip(n), format!("pod-{n}"), false))
        .collect();
    let eps: Vec<(&str, &str, bool)> = eps.iter().map(|(a, p, r)| (&**a, &**p, *r)).collect();
    cluster
        .put(SLICES, slice("pool-0", "pool", 8000, None, &eps))
        .await;
    wait_for("900 left", || async {
        (epp.metric("kvepp_ready_endpoints").await == Some(900.0)).then_some(())
    })
    .await;
    epp.stop().await;
}
