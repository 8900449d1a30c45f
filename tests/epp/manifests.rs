//! Every shipped manifest is checked the way `kubectl apply --dry-run=client` would: it parses,
//! names its kind, and what kvepp itself reads is valid for kvepp.

use std::path::Path;
use std::process::Command;

use kvepp::discovery::objects::parse_documents;
use kvepp::discovery::{Datastore, Inventory, PoolRef};
use kvepp_test_support::prelude::*;
use kvepp_test_support::shipped::{docs, envoy_validates, overlays};

/// The CRDs and the production overlay (Envoy Gateway in front of the active-active pair).
fn shipped() -> Vec<(String, serde_yaml::Value)> {
    let mut d = docs("manifests/kubernetes/crds");
    d.extend(docs("manifests/kubernetes/overlays/envoy-gateway"));
    d
}

/// The one object of `kind` named `name`.
fn named<'a>(
    docs: &'a [(String, serde_yaml::Value)],
    kind: &str,
    name: &str,
) -> &'a serde_yaml::Value {
    docs.iter()
        .map(|(_, v)| v)
        .find(|v| v["kind"] == kind && v["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("{kind} {name}"))
}

/// The value of environment variable `name` in container `c`, if set.
fn env_value<'a>(c: &'a serde_yaml::Value, name: &str) -> Option<&'a str> {
    c["env"].as_sequence()?.iter().find(|e| e["name"] == name)?["value"].as_str()
}

/// A YAML sequence of strings.
fn strings(v: &serde_yaml::Value) -> Vec<&str> {
    v.as_sequence()
        .expect("a sequence")
        .iter()
        .map(|a| a.as_str().expect("a string"))
        .collect()
}

/// The value after `flag` in an argument list.
fn flag_value<'a>(args: &[&'a str], flag: &str) -> &'a str {
    let i = args
        .iter()
        .position(|a| *a == flag)
        .unwrap_or_else(|| panic!("{flag} missing"));
    args[i + 1]
}

/// `kvepp <subcommand> --help`.
fn help(subcommand: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_kvepp"))
        .args([subcommand, "--help"])
        .output()
        .expect("run kvepp");
    String::from_utf8(out.stdout).expect("utf8")
}

/// `kvepp-agent --help` (the worker-agent image's entrypoint).
fn agent_help() -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_kvepp-agent"))
        .arg("--help")
        .output()
        .expect("run kvepp-agent");
    String::from_utf8(out.stdout).expect("utf8")
}

fn find<'a>(docs: &'a [(String, serde_yaml::Value)], kind: &str) -> Vec<&'a serde_yaml::Value> {
    docs.iter()
        .filter(|(_, v)| v["kind"] == kind)
        .map(|(_, v)| v)
        .collect()
}

#[test]
fn kubernetes_manifests_are_consistent() {
    let d = shipped();
    // RBAC: read-only, on exactly the resources kvepp watches.
    let role = find(&d, "Role")[0];
    let mut resources = Vec::new();
    for rule in role["rules"].as_sequence().unwrap() {
        let verbs = strings(&rule["verbs"]);
        assert_eq!(verbs, ["list", "watch"], "least privilege");
        for r in rule["resources"].as_sequence().unwrap() {
            resources.push(format!(
                "{}/{}",
                rule["apiGroups"][0].as_str().unwrap(),
                r.as_str().unwrap()
            ));
        }
    }
    resources.sort();
    assert_eq!(
        resources,
        [
            "discovery.k8s.io/endpointslices",
            "inference.networking.k8s.io/inferencepools",
            "inference.networking.x-k8s.io/inferencemodelrewrites",
            "inference.networking.x-k8s.io/inferencemodels",
            "inference.networking.x-k8s.io/inferencepools",
            "llm-d.ai/inferencemodelrewrites",
            "llm-d.ai/inferenceobjectives",
        ]
    );
    // The one cluster-wide grant: reading Grove's ClusterTopologies (the `cluster_topology` check).
    let cluster: Vec<_> = find(&d, "ClusterRole");
    assert_eq!(cluster.len(), 1);
    let rules = cluster[0]["rules"].as_sequence().unwrap();
    assert_eq!(rules.len(), 1);
    assert_eq!(strings(&rules[0]["apiGroups"]), ["grove.io"]);
    assert_eq!(strings(&rules[0]["resources"]), ["clustertopologies"]);
    assert_eq!(strings(&rules[0]["verbs"]), ["list"]);
    // The Deployment's flags exist, its ports and probes match the server.
    let dep = named(&d, "Deployment", "kvepp");
    let c = &dep["spec"]["template"]["spec"]["containers"][0];
    let help = help("serve");
    for arg in c["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|a| a.as_str())
        .filter(|a| a.starts_with("--"))
    {
        assert!(help.contains(arg), "{arg} is not a flag of `kvepp serve`");
    }
    let mut ports: Vec<u64> = c["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|p| p["containerPort"].as_u64().unwrap())
        .collect();
    ports.sort_unstable();
    assert_eq!(ports, [9002, 9003, 9090, 9094]);
    assert_eq!(c["readinessProbe"]["grpc"]["service"], "readiness");
    // Active-active: 2 replicas, replica sync on 9094 with peers from kvepp's own Service, the
    // index recovered through it.
    assert_eq!(dep["spec"]["replicas"], 2);
    assert_eq!(c["livenessProbe"]["grpc"]["service"], "liveness");
    // The config file in the ConfigMap is a valid kvepp configuration (but for the mounted dir),
    // and with the Deployment's environment the replicas sync.
    let cm = named(&d, "ConfigMap", "kvepp-config");
    let mut cfg: kvepp::config::Config =
        serde_yaml::from_str(cm["data"]["kvepp.yaml"].as_str().unwrap()).unwrap();
    validate_in_pod(&cfg);
    for e in c["env"].as_sequence().unwrap() {
        let name = e["name"].as_str().unwrap();
        if name.starts_with("KVEPP_") && e["value"].is_string() {
            let flag = format!(
                "--{}",
                name["KVEPP_".len()..].to_lowercase().replace('_', "-")
            );
            assert!(
                help.contains(&flag),
                "{name}: no flag {flag} of `kvepp serve`"
            );
        }
    }
    cfg.replica_sync.bind = env_value(c, "KVEPP_REPLICA_SYNC_BIND").map(str::to_owned);
    assert_eq!(cfg.replica_sync.port(), Some(9094));
    assert_eq!(
        env_value(c, "KVEPP_REPLICA_SYNC_ADVERTISE"),
        Some("tcp://$(POD_IP):9094")
    );
    let own = env_value(c, "KVEPP_REPLICA_SYNC_PEERS_SERVICE").expect("peers service");
    let own_svc = named(&d, "Service", own);
    assert!(own_svc["spec"]["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .any(|p| p["port"] == 9094));
    let recovery = env_value(c, "KVEPP_INDEXER_PEERS").expect("index recovery");
    assert_eq!(recovery, format!("http://{own}:9090"));
    // The pool's picker is the kvepp Service at its ext_proc port, and its headless Service is
    // named like it.
    let pool = find(&d, "InferencePool")[0];
    assert_eq!(pool["apiVersion"], "inference.networking.k8s.io/v1");
    assert_eq!(pool["spec"]["endpointPickerRef"]["port"]["number"], 9002);
    let svc_names: Vec<&str> = find(&d, "Service")
        .iter()
        .map(|s| s["metadata"]["name"].as_str().unwrap())
        .collect();
    assert!(svc_names.contains(&pool["spec"]["endpointPickerRef"]["name"].as_str().unwrap()));
    assert!(svc_names.contains(&pool["metadata"]["name"].as_str().unwrap()));
    for kind in ["InferenceModel", "InferenceModelRewrite"] {
        let objects = find(&d, kind);
        assert!(!objects.is_empty(), "an example {kind}");
        for m in objects {
            assert_eq!(m["spec"]["poolRef"]["name"], pool["metadata"]["name"]);
        }
    }
    // kvepp reads the pool's objects as shipped, the rewrite beside the InferenceModels.
    let text =
        std::fs::read(repo_root().join("manifests/kubernetes/pool/inference-pool.yaml")).unwrap();
    let objects = parse_documents(&text).unwrap();
    assert!(objects.iter().any(
        |o| matches!(o, kvepp::discovery::Object::Rewrite(r) if r.rules[0].targets.len() == 2)
    ));
    let route = find(&d, "HTTPRoute")[0];
    let backend = &route["spec"]["rules"][0]["backendRefs"][0];
    assert_eq!(backend["name"], pool["metadata"]["name"]);
    assert_eq!(backend["group"], "inference.networking.k8s.io");
}

/// Parses `v` as the k8s-openapi type `T` and back: a misspelled or misplaced field (which the
/// typed object drops) makes the round trip differ from the file.
fn round_trip<T: serde::de::DeserializeOwned + serde::Serialize>(
    name: &str,
    v: &serde_yaml::Value,
) {
    let json: serde_json::Value = serde_json::to_value(v).expect("YAML as JSON");
    let typed: T = serde_json::from_value(json.clone()).unwrap_or_else(|e| {
        panic!(
            "{name}: {} {}: {e}",
            v["kind"].as_str().unwrap_or(""),
            v["metadata"]["name"].as_str().unwrap_or("")
        )
    });
    let back = serde_json::to_value(&typed).expect("serialize");
    assert_eq!(
        numbers_as_floats(back),
        numbers_as_floats(json),
        "{name}: {} {} has fields its type does not know",
        v["kind"].as_str().unwrap_or(""),
        v["metadata"]["name"].as_str().unwrap_or("")
    );
}

/// Schema bounds are floats in the typed form (`minimum: 1` comes back as `1.0`).
fn numbers_as_floats(v: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match v {
        Value::Number(n) => n.as_f64().map_or(Value::Number(n), Value::from),
        Value::Object(m) => Value::Object(
            m.into_iter()
                .map(|(k, v)| (k, numbers_as_floats(v)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.into_iter().map(numbers_as_floats).collect()),
        other => other,
    }
}

#[test]
fn every_kubernetes_manifest_is_a_valid_typed_object() {
    use k8s_openapi::api::{
        apps::v1 as apps, core::v1 as core, discovery::v1 as disc, rbac::v1 as rbac,
    };
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1 as ext;
    let mut all = docs("manifests/kubernetes/crds");
    for overlay in overlays() {
        all.extend(docs(&overlay));
    }
    all.extend(docs("examples/local"));
    let mut crds = Vec::new();
    let mut untyped = Vec::new();
    for (name, v) in &all {
        match v["kind"].as_str().unwrap_or_default() {
            "Deployment" => round_trip::<apps::Deployment>(name, v),
            "Service" => round_trip::<core::Service>(name, v),
            "ServiceAccount" => round_trip::<core::ServiceAccount>(name, v),
            "ConfigMap" => round_trip::<core::ConfigMap>(name, v),
            "Role" => round_trip::<rbac::Role>(name, v),
            "RoleBinding" => round_trip::<rbac::RoleBinding>(name, v),
            "ClusterRole" => round_trip::<rbac::ClusterRole>(name, v),
            "ClusterRoleBinding" => round_trip::<rbac::ClusterRoleBinding>(name, v),
            "EndpointSlice" => round_trip::<disc::EndpointSlice>(name, v),
            "NetworkPolicy" => {
                round_trip::<k8s_openapi::api::networking::v1::NetworkPolicy>(name, v)
            }
            "PodDisruptionBudget" => {
                round_trip::<k8s_openapi::api::policy::v1::PodDisruptionBudget>(name, v)
            }
            "CustomResourceDefinition" => {
                round_trip::<ext::CustomResourceDefinition>(name, v);
                let crd: ext::CustomResourceDefinition =
                    serde_json::from_value(serde_json::to_value(v).unwrap()).unwrap();
                for ver in &crd.spec.versions {
                    crds.push((
                        format!("{}/{}", crd.spec.group, ver.name),
                        crd.spec.names.kind.clone(),
                        ver.clone(),
                    ));
                }
            }
            _ => untyped.push((name, v)),
        }
    }
    // Custom resources: a shipped CRD serves their apiVersion and kind, and every field their
    // schema requires in `spec` is there.
    for (name, v) in untyped {
        let (api, kind) = (
            v["apiVersion"].as_str().unwrap(),
            v["kind"].as_str().unwrap(),
        );
        if !api.starts_with("inference.networking.") && !api.starts_with("llm-d.ai/") {
            // Gateway API and Envoy Gateway kinds: their CRDs come with those projects.
            assert!(
                [
                    "gateway.networking.k8s.io/v1",
                    "gateway.envoyproxy.io/v1alpha1"
                ]
                .contains(&api),
                "{name}: unexpected {api} {kind}"
            );
            continue;
        }
        let (_, _, ver) = crds
            .iter()
            .find(|(a, k, _)| a == api && k == kind)
            .unwrap_or_else(|| panic!("{name}: no shipped CRD serves {api} {kind}"));
        assert!(ver.served);
        let schema = ver
            .schema
            .as_ref()
            .and_then(|s| s.open_api_v3_schema.as_ref())
            .expect("schema");
        let spec = &schema.properties.as_ref().expect("properties")["spec"];
        for field in spec.required.iter().flatten() {
            assert!(
                !v["spec"][field.as_str()].is_null(),
                "{name}: {kind} misses spec.{field}"
            );
        }
        for key in v["spec"].as_mapping().expect("spec").keys() {
            let key = key.as_str().unwrap();
            assert!(
                spec.properties
                    .as_ref()
                    .is_some_and(|p| p.contains_key(key)),
                "{name}: {kind} spec.{key} is not in the CRD schema"
            );
        }
    }
    assert_eq!(
        crds.len(),
        6,
        "InferencePool v1alpha2 and v1, InferenceModel v1alpha2, InferenceObjective llm-d.ai/v1alpha2, InferenceModelRewrite under both groups"
    );
}

#[test]
fn every_container_runs_locked_down() {
    for overlay in overlays() {
        let d = docs(&overlay);
        let deployments = find(&d, "Deployment");
        assert!(deployments.len() >= 2, "{overlay}: kvepp and vLLM");
        locked_down(&overlay, &d);
    }
}

fn locked_down(overlay: &str, d: &[(String, serde_yaml::Value)]) {
    for dep in find(d, "Deployment") {
        let pod = &dep["spec"]["template"]["spec"];
        let name = format!("{overlay}: {}", dep["metadata"]["name"].as_str().unwrap());
        assert_eq!(pod["securityContext"]["runAsNonRoot"], true, "{name}");
        assert_eq!(
            pod["securityContext"]["seccompProfile"]["type"], "RuntimeDefault",
            "{name}"
        );
        for c in pod["containers"].as_sequence().unwrap() {
            let sc = &c["securityContext"];
            let what = format!("{name}/{}", c["name"].as_str().unwrap());
            assert_eq!(sc["runAsNonRoot"], true, "{what}");
            assert!(
                sc["runAsUser"].as_u64().unwrap() > 0,
                "{what}: numeric non-root user"
            );
            assert_eq!(sc["allowPrivilegeEscalation"], false, "{what}");
            assert_eq!(sc["readOnlyRootFilesystem"], true, "{what}");
            assert_eq!(strings(&sc["capabilities"]["drop"]), ["ALL"], "{what}");
        }
    }
    // Only the gateway's Envoy pods reach ext_proc; replica sync only from kvepp itself.
    let np = find(d, "NetworkPolicy");
    assert_eq!(np.len(), 1);
    let np = np[0];
    assert_eq!(np["spec"]["podSelector"]["matchLabels"]["app"], "kvepp");
    let rules = np["spec"]["ingress"].as_sequence().unwrap();
    let admits = |port: u64| -> Vec<&serde_yaml::Value> {
        rules
            .iter()
            .filter(|r| {
                r["ports"]
                    .as_sequence()
                    .unwrap()
                    .iter()
                    .any(|p| p["port"].as_u64() == Some(port))
            })
            .flat_map(|r| r["from"].as_sequence().unwrap())
            .collect()
    };
    let ext_proc = admits(9002);
    assert_eq!(ext_proc.len(), 1, "one peer for ext_proc");
    assert_eq!(
        ext_proc[0]["podSelector"]["matchLabels"]["app.kubernetes.io/name"],
        "envoy"
    );
    assert!(!ext_proc[0]["namespaceSelector"].is_null());
    let sync = admits(9094);
    assert_eq!(sync.len(), 1);
    assert_eq!(sync[0]["podSelector"]["matchLabels"]["app"], "kvepp");
    // kvepp's configuration: TLS only on ext_proc, a token, admin ports on the pod IP for probes.
    let cm = named(d, "ConfigMap", "kvepp-config");
    let cfg: kvepp::config::Config =
        serde_yaml::from_str(cm["data"]["kvepp.yaml"].as_str().unwrap()).unwrap();
    assert!(!cfg.grpc_tls.accept_plaintext);
    assert_ne!(cfg.grpc_tls.mode, kvepp::config::TlsMode::Off);
    let token = cfg.api_token_file.expect("api_token_file");
    let dep = named(d, "Deployment", "kvepp");
    let pod = &dep["spec"]["template"]["spec"];
    let mount = pod["containers"][0]["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| token.starts_with(m["mountPath"].as_str().unwrap()))
        .expect("the token file is on a mounted volume");
    let vol = pod["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    assert_eq!(vol["secret"]["secretName"], "kvepp-api-token");
}

#[test]
fn vllm_example_wires_the_worker_agent_to_the_pool() {
    let d = shipped();
    let dep = find(&d, "Deployment")
        .into_iter()
        .find(|d| d["metadata"]["name"] == "vllm-llama3-8b")
        .expect("vLLM Deployment");
    let pod = &dep["spec"]["template"];
    let component = pod["metadata"]["labels"]["kvepp.io/component"]
        .as_str()
        .expect("component label");
    let containers = pod["spec"]["containers"].as_sequence().unwrap();
    let vllm = &containers[0];
    let args = strings(&vllm["args"]);
    let kv = flag_value(&args, "--kv-events-config");
    let kv: serde_json::Value = serde_json::from_str(kv).expect("--kv-events-config is JSON");
    assert_eq!(kv["publisher"], "zmq");
    assert_eq!(kv["endpoint"], "tcp://*:5557");
    assert_eq!(kv["replay_endpoint"], "tcp://*:5558");
    assert_eq!(kv["enable_kv_cache_events"], true);
    let agent = containers
        .iter()
        .find(|c| c["name"] == "worker-agent")
        .expect("sidecar");
    let aargs = strings(&agent["args"]);
    assert_eq!(
        agent["image"], "kvepp/worker-agent:0.1.0",
        "the worker-agent image, whose entrypoint is kvepp-agent"
    );
    let help = agent_help();
    for a in aargs.iter().filter(|a| a.starts_with("--")) {
        assert!(help.contains(a), "{a} is not a flag of `kvepp-agent`");
    }
    let arg = |flag: &str| flag_value(&aargs, flag);
    assert_eq!(arg("--component"), component);
    assert_eq!(arg("--kv-events-port"), "5557");
    assert_eq!(arg("--block-size"), flag_value(&args, "--block-size"));
    let listen: std::net::SocketAddr = arg("--listen").parse().unwrap();
    assert_eq!(agent["readinessProbe"]["httpGet"]["path"], "/health");
    assert_eq!(
        agent["readinessProbe"]["httpGet"]["port"].as_u64(),
        Some(u64::from(listen.port()))
    );
    // The Downward API gives the agent the labels it checks and the pod's identity.
    let vol = &pod["spec"]["volumes"][0]["downwardAPI"]["items"][0];
    assert_eq!(vol["fieldRef"]["fieldPath"], "metadata.labels");
    assert!(arg("--labels-file").ends_with(vol["path"].as_str().unwrap()));
    let env: Vec<&str> = agent["env"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        env,
        [
            "POD_NAME",
            "POD_NAMESPACE",
            "POD_IP",
            "DYN_TOPOLOGY_ENABLED"
        ]
    );
    // One file per topology level, projected from the pod's labels into the directory the agent
    // reads by default (its `--topology-dir`).
    let items = pod["spec"]["volumes"][0]["downwardAPI"]["items"]
        .as_sequence()
        .unwrap();
    let mount = agent["volumeMounts"][0]["mountPath"].as_str().unwrap();
    assert!(help.contains("/etc/podinfo/topology"), "{help}");
    let levels: Vec<(&str, &str)> = items
        .iter()
        .filter_map(|i| {
            let path = i["path"].as_str()?.strip_prefix("topology/")?;
            Some((path, i["fieldRef"]["fieldPath"].as_str()?))
        })
        .collect();
    assert_eq!(mount, "/etc/podinfo");
    assert!(levels.contains(&("zone", "metadata.labels['grove.io/topology.zone']")));
    assert!(levels.len() >= 2, "{levels:?}");
    // The pool's headless Service selects the pods and publishes the http and metadata ports.
    let svc = find(&d, "Service")
        .into_iter()
        .find(|s| s["metadata"]["name"] == component)
        .expect("the component's Service");
    assert_eq!(svc["spec"]["clusterIP"], "None");
    assert_eq!(svc["spec"]["selector"]["kvepp.io/component"], component);
    let ports: Vec<(&str, u64)> = svc["spec"]["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap(),
                p["targetPort"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        ports,
        [("http", 8000), ("metadata", u64::from(listen.port()))]
    );
    // kvepp's config names this Service and needs no manifests directory.
    let cm = find(&d, "ConfigMap")
        .into_iter()
        .find(|m| m["metadata"]["name"] == "kvepp-config")
        .unwrap();
    let cfg: kvepp::config::Config =
        serde_yaml::from_str(cm["data"]["kvepp.yaml"].as_str().unwrap()).unwrap();
    assert_eq!(cfg.endpoint_service(), component);
    assert!(cfg.manifests_dir.is_none());
    validate_in_pod(&cfg);
}

/// Validates kvepp's configuration as in its pod, where the token file is a mounted Secret.
fn validate_in_pod(cfg: &kvepp::config::Config) {
    let secret = kvepp_test_support::TempDir::new("token");
    let token = secret.path().join("token");
    std::fs::write(&token, "x").unwrap();
    kvepp::config::Config {
        api_token_file: Some(token),
        ..cfg.clone()
    }
    .validate()
    .unwrap();
}

#[test]
fn local_example_gives_a_ready_pool() {
    let store = Datastore::new(
        PoolRef {
            name: "demo-pool".into(),
            namespace: "default".into(),
            service: "demo-pool".into(),
            picker_service: None,
        },
        |_| {},
    );
    let mut objects = Vec::new();
    for f in ["examples/local/pool.yaml", "examples/local/models.yaml"] {
        objects.extend(parse_documents(&std::fs::read(repo_root().join(f)).unwrap()).unwrap());
    }
    docs("examples/local");
    store.apply(&Inventory { objects });
    let snap = store.snapshot();
    let eps: Vec<&str> = snap.endpoints.iter().map(|e| &*e.addr_str).collect();
    assert_eq!(
        eps,
        ["127.0.0.1:18001", "127.0.0.1:18002"],
        "model-server-c is not ready"
    );
    assert_eq!(snap.models.len(), 3);
}

#[test]
fn envoy_bootstrap_validates() {
    let path = repo_root().join("manifests/envoy/envoy-local.yaml");
    assert!(Path::new(&path).exists());
    envoy_validates(&path);
    // The facts the protocol depends on are in the shipped file.
    let b = bootstrap();
    let ext = b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"]["http_filters"][0]["typed_config"]
        .clone();
    assert_eq!(
        ext["metadata_options"]["receiving_namespaces"]["untyped"][0],
        "envoy.lb"
    );
    assert_eq!(ext["processing_mode"]["request_trailer_mode"], "SEND");
    let pool = b["static_resources"]["clusters"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "inference_pool")
        .unwrap()
        .clone();
    assert_eq!(pool["type"], "ORIGINAL_DST");
    assert_eq!(
        pool["original_dst_lb_config"]["http_header_name"],
        "x-gateway-destination-endpoint"
    );
}

/// Each overlay is the shape its name says: one replica; two replicas that sync; prefill and
/// decode workers that publish their role and topology; Envoy Gateway in front of the pair.
#[test]
fn overlays_give_the_shapes_people_run() {
    let names: Vec<String> = overlays()
        .iter()
        .map(|o| o.rsplit('/').next().unwrap().to_owned())
        .collect();
    assert_eq!(
        names,
        [
            "active-active",
            "envoy-gateway",
            "pd-pool",
            "single-replica"
        ]
    );
    let kvepp = |d: &[(String, serde_yaml::Value)]| {
        named(d, "Deployment", "kvepp")["spec"]["template"]["spec"]["containers"][0].clone()
    };
    let overlay = |name: &str| docs(&format!("manifests/kubernetes/overlays/{name}"));

    let single = overlay("single-replica");
    assert_eq!(named(&single, "Deployment", "kvepp")["spec"]["replicas"], 1);
    assert_eq!(env_value(&kvepp(&single), "KVEPP_REPLICA_SYNC_BIND"), None);
    assert_eq!(find(&single, "PodDisruptionBudget").len(), 1);
    assert!(find(&single, "HTTPRoute").is_empty());

    let pair = overlay("active-active");
    assert_eq!(named(&pair, "Deployment", "kvepp")["spec"]["replicas"], 2);
    assert_eq!(
        env_value(&kvepp(&pair), "KVEPP_REPLICA_SYNC_BIND"),
        Some("tcp://*:9094")
    );

    // Envoy Gateway: the pair, plus the gateway's objects.
    let gateway = overlay("envoy-gateway");
    for (_, v) in &pair {
        assert!(
            gateway.iter().any(|(_, g)| g == v),
            "envoy-gateway lacks {} {}",
            v["kind"].as_str().unwrap(),
            v["metadata"]["name"].as_str().unwrap()
        );
    }
    for kind in [
        "Gateway",
        "HTTPRoute",
        "EnvoyExtensionPolicy",
        "InferencePool",
    ] {
        assert_eq!(find(&gateway, kind).len(), 1, "{kind}");
    }

    // P/D: a prefill and a decode Deployment of the pool, told apart by the role label the agent
    // reads, both selected by the pool, both constrained to the topology level kvepp uses.
    let pd = overlay("pd-pool");
    let pool = find(&pd, "InferencePool")[0];
    let picker = kvepp(&pd);
    let level = env_value(&picker, "DYN_ROUTER_KV_TRANSFER_TOPOLOGY_LEVEL").expect("level");
    let help = agent_help();
    for role in ["prefill", "decode"] {
        let dep = named(&pd, "Deployment", &format!("vllm-llama3-8b-{role}"));
        let pod = &dep["spec"]["template"];
        assert_eq!(pod["metadata"]["labels"]["llm-d.ai/role"], role);
        assert_eq!(
            dep["spec"]["selector"]["matchLabels"]["llm-d.ai/role"],
            role
        );
        for (k, v) in pool["spec"]["selector"]["matchLabels"]
            .as_mapping()
            .unwrap()
        {
            assert_eq!(
                &pod["metadata"]["labels"][k], v,
                "{role}: the pool selects it"
            );
        }
        let containers = pod["spec"]["containers"].as_sequence().unwrap();
        let vllm = containers.iter().find(|c| c["name"] == "vllm").unwrap();
        let args = strings(&vllm["args"]);
        let transfer: serde_json::Value =
            serde_json::from_str(flag_value(&args, "--kv-transfer-config")).expect("JSON");
        assert_eq!(transfer["kv_connector"], "NixlConnector");
        let agent = containers
            .iter()
            .find(|c| c["name"] == "worker-agent")
            .unwrap();
        let aargs = strings(&agent["args"]);
        assert!(
            !aargs.contains(&"--role"),
            "{role}: the role comes from the label"
        );
        assert!(
            help.contains("llm-d.ai/role"),
            "the agent's default --role-label"
        );
        assert_eq!(
            env_value(agent, "DYN_ROUTER_KV_TRANSFER_TOPOLOGY_LEVEL"),
            Some(level)
        );
        let items = pod["spec"]["volumes"][0]["downwardAPI"]["items"]
            .as_sequence()
            .unwrap();
        assert!(
            items
                .iter()
                .any(|i| i["path"] == format!("topology/{level}").as_str()),
            "{role}: the level's Downward API file"
        );
    }
    assert!(
        !pd.iter()
            .any(|(_, v)| v["kind"] == "Deployment" && v["metadata"]["name"] == "vllm-llama3-8b"),
        "no aggregated workers in the P/D pool"
    );
}

/// The Helm chart's renderings (`helm template` with each values file of manifests/helm/values)
/// give the shapes of the Kustomize overlays of the same names: every object the chart renders is
/// one the overlay renders (kind and name), every kind of the overlay is there (the Grove
/// ClusterRole only when a ClusterTopology is configured), kvepp's Role, replicas, container
/// arguments, environment and configuration are the overlay's, the engines' Deployments and
/// replicas too; every container runs locked down.
#[test]
fn helm_chart_gives_the_overlays_shapes() {
    use kvepp_test_support::kube_cluster::{documents, helm_template};
    let key = |v: &serde_yaml::Value| {
        (
            v["kind"].as_str().unwrap().to_owned(),
            v["metadata"]["name"].as_str().unwrap().to_owned(),
        )
    };
    for overlay in overlays() {
        let shape = overlay.rsplit('/').next().unwrap().to_owned();
        let kust = docs(&overlay);
        let chart: Vec<(String, serde_yaml::Value)> = documents(&helm_template(&shape))
            .into_iter()
            .map(|v| {
                let v: serde_yaml::Value = serde_yaml::to_value(v).unwrap();
                (format!("helm {shape}: {:?}", key(&v)), v)
            })
            .collect();
        let kust_keys: std::collections::BTreeSet<_> = kust.iter().map(|(_, v)| key(v)).collect();
        let chart_keys: std::collections::BTreeSet<_> = chart.iter().map(|(_, v)| key(v)).collect();
        for k in &chart_keys {
            assert!(
                kust_keys.contains(k),
                "{shape}: the chart renders {k:?}, the overlay does not"
            );
        }
        let kinds = |s: &std::collections::BTreeSet<(String, String)>| -> std::collections::BTreeSet<String> {
            s.iter().map(|(k, _)| k.clone()).collect()
        };
        let missing: Vec<String> = kinds(&kust_keys)
            .difference(&kinds(&chart_keys))
            .filter(|k| !k.starts_with("ClusterRole"))
            .cloned()
            .collect();
        assert!(
            missing.is_empty(),
            "{shape}: the chart renders no {missing:?}"
        );
        assert_eq!(
            named(&chart, "Role", "kvepp")["rules"],
            named(&kust, "Role", "kvepp")["rules"],
            "{shape}: kvepp's Role"
        );
        let (cd, kd) = (
            named(&chart, "Deployment", "kvepp"),
            named(&kust, "Deployment", "kvepp"),
        );
        assert_eq!(cd["spec"]["replicas"], kd["spec"]["replicas"], "{shape}");
        let (cc, kc) = (
            &cd["spec"]["template"]["spec"]["containers"][0],
            &kd["spec"]["template"]["spec"]["containers"][0],
        );
        assert_eq!(cc["args"], kc["args"], "{shape}: kvepp's arguments");
        let env_names = |c: &serde_yaml::Value| -> Vec<String> {
            let mut v: Vec<String> = c["env"]
                .as_sequence()
                .unwrap()
                .iter()
                .map(|e| e["name"].as_str().unwrap().to_owned())
                .collect();
            v.sort();
            v
        };
        assert_eq!(env_names(cc), env_names(kc), "{shape}: kvepp's environment");
        for e in cc["env"].as_sequence().unwrap() {
            let name = e["name"].as_str().unwrap();
            if let Some(v) = e["value"].as_str() {
                assert_eq!(env_value(kc, name), Some(v), "{shape}: {name}");
            }
        }
        assert_eq!(
            cd["spec"]["template"]["spec"]["terminationGracePeriodSeconds"],
            kd["spec"]["template"]["spec"]["terminationGracePeriodSeconds"],
            "{shape}"
        );
        for dep in find(&kust, "Deployment") {
            let name = dep["metadata"]["name"].as_str().unwrap();
            let c = named(&chart, "Deployment", name);
            assert_eq!(
                c["spec"]["replicas"], dep["spec"]["replicas"],
                "{shape}: {name}"
            );
            assert_eq!(
                c["spec"]["selector"], dep["spec"]["selector"],
                "{shape}: {name}'s selector"
            );
        }
        // kvepp's configuration as the chart writes it: the overlay's, valid in the pod.
        let config = |d: &[(String, serde_yaml::Value)]| -> kvepp::config::Config {
            let cm = named(d, "ConfigMap", "kvepp-config");
            serde_yaml::from_str(cm["data"]["kvepp.yaml"].as_str().unwrap()).unwrap()
        };
        let (cc, kc) = (config(&chart), config(&kust));
        validate_in_pod(&cc);
        assert_eq!(
            serde_json::to_value(&cc).unwrap(),
            serde_json::to_value(&kc).unwrap(),
            "{shape}: kvepp's configuration"
        );
        locked_down(&format!("helm {shape}"), &chart);
    }
}

/// The chart's values reference (the table in manifests/helm/kvepp/README.md) is generated from
/// values.schema.json (types, descriptions) and values.yaml (defaults); every value has a type
/// and a description, and every default is one the schema names. `KVEPP_WRITE_DOCS=1` rewrites
/// the table instead of comparing.
#[test]
fn helm_values_reference_matches_the_schema() {
    let chart = repo_root().join("manifests/helm/kvepp");
    let schema: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(chart.join("values.schema.json")).unwrap())
            .unwrap();
    let values: serde_json::Value =
        serde_yaml::from_str(&std::fs::read_to_string(chart.join("values.yaml")).unwrap()).unwrap();
    let mut rows = Vec::new();
    let mut undocumented = Vec::new();
    helm_rows("", &schema, &values, &mut rows, &mut undocumented);
    assert!(
        undocumented.is_empty(),
        "values without a description: {undocumented:?}"
    );
    fn leaves(prefix: &str, v: &serde_json::Value, out: &mut Vec<String>) {
        match v.as_object() {
            Some(m) if !m.is_empty() => {
                for (k, v) in m {
                    leaves(&format!("{prefix}{k}."), v, out);
                }
            }
            _ => out.push(prefix.trim_end_matches('.').to_owned()),
        }
    }
    let mut defaults = Vec::new();
    leaves("", &values, &mut defaults);
    let described: Vec<&str> = rows
        .iter()
        .map(|r| r.split('`').nth(1).unwrap_or_default())
        .collect();
    for d in defaults {
        assert!(
            described
                .iter()
                .any(|p| d == *p || d.starts_with(&format!("{p}."))),
            "values.yaml sets {d}, which the schema does not describe"
        );
    }
    let table = format!(
        "| value | type | default | what it does |\n|---|---|---|---|\n{}\n",
        rows.join("\n")
    );
    let readme_path = chart.join("README.md");
    let readme = std::fs::read_to_string(&readme_path).unwrap();
    let (start, end) = ("<!-- values: begin -->\n", "<!-- values: end -->");
    let (head, rest) = readme.split_at(readme.find(start).expect("begin marker") + start.len());
    let tail = &rest[rest.find(end).expect("end marker")..];
    let generated = format!("{head}{table}{tail}");
    if std::env::var_os("KVEPP_WRITE_DOCS").is_some() {
        std::fs::write(&readme_path, generated).unwrap();
        return;
    }
    assert!(
        readme == generated,
        "manifests/helm/kvepp/README.md's values table differs from values.schema.json and \
         values.yaml; regenerate it with `KVEPP_WRITE_DOCS=1 cargo test -p kvepp --test epp manifests::helm_values`"
    );
}

/// One table row per value: objects with properties recurse, the rest are leaves.
fn helm_rows(
    path: &str,
    schema: &serde_json::Value,
    default: &serde_json::Value,
    rows: &mut Vec<String>,
    undocumented: &mut Vec<String>,
) {
    if let Some(props) = schema["properties"].as_object() {
        for (k, s) in props {
            let p = if path.is_empty() {
                k.clone()
            } else {
                format!("{path}.{k}")
            };
            helm_rows(&p, s, &default[k], rows, undocumented);
        }
        return;
    }
    let Some(description) = schema["description"].as_str() else {
        undocumented.push(path.to_owned());
        return;
    };
    let mut ty = schema["type"].as_str().unwrap_or("any").to_owned();
    if let Some(e) = schema["enum"].as_array() {
        ty = e
            .iter()
            .map(|v| format!("`{}`", v.as_str().unwrap_or_default()))
            .collect::<Vec<_>>()
            .join(" \\| ");
    }
    let shown = match default {
        serde_json::Value::Null => "unset".to_owned(),
        serde_json::Value::String(s) if s.is_empty() => "`\"\"`".to_owned(),
        serde_json::Value::Array(a) if a.is_empty() => "none".to_owned(),
        serde_json::Value::Object(o) if o.is_empty() => "`{}`".to_owned(),
        serde_json::Value::String(s) => format!("`{s}`"),
        v => format!(
            "`{}`",
            serde_json::to_string(v).unwrap().replace('|', "\\|")
        ),
    };
    rows.push(format!("| `{path}` | {ty} | {shown} | {description} |"));
}
