//! The mesh file's `discovery`, `etcd`, `cpu_kernels` and `device` settings: parsed, normalized, and
//! refused naming the field, the value and the reason.

use std::path::Path;
use std::time::Duration;

use kvmesh_kernels::cpu::CpuKernels;

use super::{DiscoveryKind, MeshConfig};

const BASE: &str = "mesh: {insecure_no_mesh_auth: true}\n\
                    router: {http: \"127.0.0.1:1\", grpc: \"127.0.0.1:2\"}\n";
const NODES: &str = "prefill: [{name: p, grpc: \"127.0.0.1:3\"}]\n\
                     decode: [{name: d, grpc: \"127.0.0.1:4\", kv: \"127.0.0.1:5\"}]\n";
const ETCD: &str =
    "discovery: etcd\netcd: {endpoints: [etcd:2379], prefix: /kvmesh/t, allow_insecure_etcd: true}\n";

fn parse(text: &str) -> anyhow::Result<MeshConfig> {
    MeshConfig::parse(text, Path::new("/t/mesh.yaml"))
}

fn refused(text: &str) -> String {
    match parse(text) {
        Ok(_) => panic!("accepted: {text}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn static_is_the_default_and_needs_both_roles() {
    let cfg = parse(&format!("{BASE}{NODES}")).expect("valid");
    assert_eq!(cfg.discovery, DiscoveryKind::Static);
    assert_eq!(cfg.etcd("router").expect("no etcd"), None);
    let cfg = parse(&format!("{BASE}{NODES}discovery: static\n")).expect("valid");
    assert_eq!(cfg.discovery, DiscoveryKind::Static);
    assert!(
        refused(BASE).contains("prefill = \"[]\": the mesh needs at least one node of each role")
    );
}

#[test]
fn etcd_settings_are_normalized_with_defaults() {
    let cfg = parse(&format!("{BASE}{NODES}{ETCD}")).expect("valid");
    assert_eq!(cfg.discovery, DiscoveryKind::Etcd);
    let e = cfg.etcd("router").expect("valid").expect("etcd");
    assert_eq!(e.endpoints, ["http://etcd:2379"]);
    assert_eq!(e.prefix, "/kvmesh/t/");
    assert_eq!(e.lease_ttl, Duration::from_secs(3));
    assert_eq!(e.dial_timeout, Duration::from_secs(2));
    let cfg = parse(&format!(
        "{BASE}discovery: etcd\netcd: {{endpoints: [\"http://a:1\", \"b:2\"], prefix: /m/, lease_ttl_s: 10, dial_timeout_ms: 500, allow_insecure_etcd: true}}\n"
    ))
    .expect("valid");
    let e = cfg.etcd("router").expect("valid").expect("etcd");
    assert_eq!(e.endpoints, ["http://a:1", "http://b:2"]);
    assert_eq!(e.lease_ttl, Duration::from_secs(10));
    assert_eq!(e.dial_timeout, Duration::from_millis(500));
    // The router of an etcd mesh needs no node list.
    assert!(cfg.prefill.is_empty() && cfg.decode.is_empty());
}

#[test]
fn etcd_needs_mutual_tls_unless_a_test_mesh_says_otherwise() {
    let plain = "discovery: etcd\netcd: {endpoints: [etcd:2379], prefix: /k/}\n";
    let e = refused(&format!("{BASE}{NODES}{plain}"));
    assert!(
        e.contains("mesh.tls = \"\": discovery: etcd needs mutual TLS between the nodes"),
        "{e}"
    );
    assert!(e.contains("allow_insecure_etcd: true"), "{e}");
    // With mesh.tls and etcd.tls: https endpoints, each process's own
    // client certificate.
    let tls = "mesh: {secret_file: s, tls: {ca_file: ca.pem, cert_file: \"{name}.pem\", key_file: \"{name}.key\"}}\n\
               router: {http: \"127.0.0.1:1\", grpc: \"127.0.0.1:2\"}\n\
               discovery: etcd\n\
               etcd: {endpoints: [etcd:2379], prefix: /k/, tls: {ca_file: etcd-ca.pem, cert_file: \"etcd-{name}.pem\", key_file: \"/abs/etcd-{name}.key\"}}\n";
    let cfg = parse(tls).expect("valid");
    let e = cfg.etcd("decode-0").expect("valid").expect("etcd");
    assert_eq!(e.endpoints, ["https://etcd:2379"]);
    let t = e.tls.expect("tls");
    assert_eq!(t.ca, Path::new("/t/etcd-ca.pem"));
    assert_eq!(t.cert, Path::new("/t/etcd-decode-0.pem"));
    assert_eq!(t.key, Path::new("/abs/etcd-decode-0.key"));
    let e = refused(&tls.replace("[etcd:2379]", "[\"http://etcd:2379\"]"));
    assert!(e.contains("in the clear: use https://"), "{e}");
}

#[test]
fn bad_discovery_settings_name_field_value_and_reason() {
    let cases = [
        (
            format!("{BASE}{NODES}discovery: consul\n"),
            "discovery = \"consul\": expected static or etcd",
        ),
        (
            format!("{BASE}{NODES}discovery: etcd\n"),
            "etcd = \"\": discovery: etcd needs an etcd section",
        ),
        (
            format!("{BASE}{NODES}etcd: {{endpoints: [a:1], prefix: /k/}}\n"),
            "etcd = \"{...}\": only read with discovery: etcd",
        ),
        (
            format!("{BASE}{NODES}discovery: etcd\netcd: {{endpoints: [a:1]}}\n"),
            "etcd.prefix = \"\": required",
        ),
        (
            format!("{BASE}{NODES}discovery: etcd\netcd: {{endpoints: [], prefix: /k/}}\n"),
            "etcd.endpoints = \"[]\": name at least one etcd member",
        ),
        (
            format!("{BASE}{NODES}discovery: etcd\netcd: {{endpoints: [\"https://a:1\"], prefix: /k/}}\n"),
            "etcd.endpoints = \"https://a:1\": https:// needs etcd.tls",
        ),
        (
            format!("{BASE}{NODES}discovery: etcd\netcd: {{endpoints: [a], prefix: /k/}}\n"),
            "etcd.endpoints = \"a\": expected HOST:PORT",
        ),
        (
            format!("{BASE}{NODES}discovery: etcd\netcd: {{endpoints: [a:1], prefix: k}}\n"),
            "etcd.prefix = \"k\": a key prefix of this mesh",
        ),
        (
            format!("{BASE}{NODES}discovery: etcd\netcd: {{endpoints: [a:1], prefix: /k/, lease_ttl_s: 1}}\n"),
            "etcd.lease_ttl_s = \"1\": 2 to 300 seconds",
        ),
        (
            format!("{BASE}{NODES}discovery: etcd\netcd: {{endpoints: [a:1], prefix: /k/, dial_timeout_ms: 0}}\n"),
            "etcd.dial_timeout_ms = \"0\": must be at least 1",
        ),
        (
            format!("{BASE}{NODES}discovery: etcd\netcd: {{endpoints: [a:1], prefix: /k/, ttl: 3}}\n"),
            "unknown field `ttl`",
        ),
        (
            format!("{BASE}{ETCD}decode: [{{name: \"d/0\", grpc: \"h:4\", kv: \"h:5\"}}]\n"),
            "decode[0].name = \"d/0\": with discovery: etcd, letters, digits",
        ),
        (
            format!("{BASE}{ETCD}prefill: [{{name: p, grpc: \"a b:3\"}}]\n"),
            "prefill[0].grpc = \"a b:3\": the host must be a DNS name or an IP address",
        ),
    ];
    for (text, want) in cases {
        let e = refused(&text);
        assert!(e.contains(want), "{want:?} not in {e}");
        assert!(e.starts_with("/t/mesh.yaml: "), "{e}");
    }
}

#[test]
fn a_node_registers_its_name_role_and_addresses() {
    let cfg = parse(&format!("{BASE}{NODES}{ETCD}")).expect("valid");
    let d = cfg.member("decode", &cfg.decode[0]).expect("member");
    assert_eq!(
        (d.name.as_str(), d.role, d.grpc.as_str(), d.kv.as_deref()),
        (
            "d",
            kvmesh_discovery::Role::Decode,
            "127.0.0.1:4",
            Some("tcp://127.0.0.1:5")
        )
    );
    assert_eq!(d.key("/kvmesh/t/"), "/kvmesh/t/decode/d");
    let p = cfg.member("prefill", &cfg.prefill[0]).expect("member");
    assert_eq!((p.role, p.kv), (kvmesh_discovery::Role::Prefill, None));
    // With shared memory the KV endpoint is the socket path, as grants say.
    let shm = parse(&format!(
        "{BASE}{ETCD}transport: shm\ndecode: [{{name: d, grpc: \"h:4\", kv: /run/k.sock}}]\n"
    ))
    .expect("valid");
    let d = shm.member("decode", &shm.decode[0]).expect("member");
    assert_eq!(d.kv.as_deref(), Some("unix:/run/k.sock"));
}

#[test]
fn the_ucx_transport_takes_a_tcp_kv_address_and_an_optional_ucx_listener() {
    let ucx = "transport: ucx\nprefill: [{name: p, grpc: \"127.0.0.1:3\"}]\n";
    let cfg = parse(&format!(
        "{BASE}{ucx}decode: [{{name: d, grpc: \"127.0.0.1:4\", kv: \"127.0.0.1:5\"}}]\n"
    ))
    .expect("valid");
    assert_eq!(cfg.kv_endpoint(&cfg.decode[0]), "tcp://127.0.0.1:5");
    // By default where the node is advertised (`kv`'s IP), any port.
    assert_eq!(
        cfg.decode[0].ucx_listen_addr().expect("default"),
        "127.0.0.1:0".parse::<std::net::SocketAddr>().expect("addr")
    );
    let all = parse(&format!(
        "{BASE}{ucx}decode: [{{name: d, grpc: \"127.0.0.1:4\", kv: \"0.0.0.0:5\"}}]\n"
    ))
    .expect("valid");
    assert_eq!(
        all.decode[0].ucx_listen_addr().expect("default"),
        "0.0.0.0:0".parse::<std::net::SocketAddr>().expect("addr")
    );
    let cfg = parse(&format!(
        "{BASE}{ucx}decode: [{{name: d, grpc: \"127.0.0.1:4\", kv: \"127.0.0.1:5\", ucx_listen: \"10.0.0.7:7401\"}}]\n"
    ))
    .expect("valid");
    assert_eq!(
        cfg.decode[0].ucx_listen_addr().expect("set"),
        "10.0.0.7:7401"
            .parse::<std::net::SocketAddr>()
            .expect("addr")
    );
    // UCX binds an address, not a name; and only the ucx transport has one.
    let e = refused(&format!(
        "{BASE}{ucx}decode: [{{name: d, grpc: \"127.0.0.1:4\", kv: \"127.0.0.1:5\", ucx_listen: \"decode-0:7401\"}}]\n"
    ));
    assert!(e.contains("ucx_listen") && e.contains("IP:PORT"), "{e}");
    let e = refused(&format!(
        "{BASE}prefill: [{{name: p, grpc: \"127.0.0.1:3\"}}]\ndecode: [{{name: d, grpc: \"127.0.0.1:4\", kv: \"127.0.0.1:5\", ucx_listen: \"0.0.0.0:1\"}}]\n"
    ));
    assert!(e.contains("only with transport: ucx"), "{e}");
    let e = refused(&format!("{BASE}{NODES}transport: rdma\n"));
    assert!(e.contains("expected tcp, shm or ucx"), "{e}");
}

#[test]
fn cpu_kernels_default_to_auto_and_a_node_may_set_its_own() {
    let cfg = parse(&format!("{BASE}{NODES}")).expect("valid");
    assert_eq!(
        cfg.cpu_kernels_for("prefill", Some("p")).expect("valid"),
        CpuKernels::Auto
    );
    let cfg = parse(&format!(
        "{BASE}cpu_kernels: avx2\nprefill: [{{name: p, grpc: \"127.0.0.1:3\", cpu_kernels: portable}}]\n\
         decode: [{{name: d, grpc: \"127.0.0.1:4\", kv: \"127.0.0.1:5\"}}]\n"
    ))
    .expect("valid");
    assert_eq!(
        cfg.cpu_kernels_for("prefill", Some("p")).expect("valid"),
        CpuKernels::Portable
    );
    assert_eq!(
        cfg.cpu_kernels_for("decode", Some("d")).expect("valid"),
        CpuKernels::Avx2
    );
    assert_eq!(
        cfg.cpu_kernels_for("router", None).expect("valid"),
        CpuKernels::Avx2
    );
    assert!(
        refused(&format!("{BASE}{NODES}cpu_kernels: sse\n"))
            .contains("cpu_kernels = \"sse\": unknown CPU kernel path \"sse\": expected auto, avx512, avx2 or portable"),
        "{}",
        refused(&format!("{BASE}{NODES}cpu_kernels: sse\n"))
    );
    let bad_node = format!(
        "{BASE}prefill: [{{name: p, grpc: \"127.0.0.1:3\", cpu_kernels: avx1024}}]\n\
         decode: [{{name: d, grpc: \"127.0.0.1:4\", kv: \"127.0.0.1:5\"}}]\n"
    );
    assert!(
        refused(&bad_node).contains("prefill[0].cpu_kernels = \"avx1024\""),
        "{}",
        refused(&bad_node)
    );
}

#[test]
fn device_defaults_to_cpu_and_a_node_may_set_its_own() {
    use kvmesh_cuda::DeviceSpec;
    let cfg = parse(&format!("{BASE}{NODES}")).expect("valid");
    assert_eq!(
        cfg.device_for("decode", Some("d")).expect("valid"),
        DeviceSpec::Cpu
    );
    let cfg = parse(&format!(
        "{BASE}device: cuda\nprefill: [{{name: p, grpc: \"127.0.0.1:3\", device: \"cuda:1\"}}]\n\
         decode: [{{name: d, grpc: \"127.0.0.1:4\", kv: \"127.0.0.1:5\"}}]\n"
    ))
    .expect("valid");
    assert_eq!(
        cfg.device_for("prefill", Some("p")).expect("valid"),
        DeviceSpec::Cuda(1)
    );
    assert_eq!(
        cfg.device_for("decode", Some("d")).expect("valid"),
        DeviceSpec::Cuda(0)
    );
    let msg = refused(&format!("{BASE}{NODES}device: gpu\n"));
    assert!(
        msg.contains("device = \"gpu\"") && msg.contains("expected cpu, cuda or cuda:N"),
        "{msg}"
    );
    let bad_node = format!(
        "{BASE}prefill: [{{name: p, grpc: \"127.0.0.1:3\"}}]\n\
         decode: [{{name: d, grpc: \"127.0.0.1:4\", kv: \"127.0.0.1:5\", device: \"cuda:-1\"}}]\n"
    );
    assert!(
        refused(&bad_node).contains("decode[0].device = \"cuda:-1\""),
        "{}",
        refused(&bad_node)
    );
}

#[test]
fn device_weights_default_to_f32_and_a_node_may_set_its_own() {
    use kvmesh_cuda::ops::WeightDtype;
    let cfg = parse(&format!("{BASE}{NODES}")).expect("valid");
    assert_eq!(
        cfg.device_weights_for("decode", Some("d")).expect("valid"),
        WeightDtype::F32
    );
    let cfg = parse(&format!(
        "{BASE}device: cuda\ndevice_weights: bf16\nprefill: [{{name: p, grpc: \"127.0.0.1:3\", device_weights: f16}}]\n\
         decode: [{{name: d, grpc: \"127.0.0.1:4\", kv: \"127.0.0.1:5\"}}]\n"
    ))
    .expect("valid");
    assert_eq!(
        cfg.device_weights_for("prefill", Some("p")).expect("valid"),
        WeightDtype::F16
    );
    assert_eq!(
        cfg.device_weights_for("decode", Some("d")).expect("valid"),
        WeightDtype::Bf16
    );
    let msg = refused(&format!("{BASE}{NODES}device_weights: fp8\n"));
    assert!(
        msg.contains("device_weights = \"fp8\"") && msg.contains("expected f32, f16 or bf16"),
        "{msg}"
    );
}

#[test]
fn the_router_parsers_default_to_auto_and_unknown_names_are_refused() {
    let cfg = parse(&format!("{BASE}{NODES}")).expect("valid");
    let (tool, reasoning) = cfg.router.parsers(&cfg.file).expect("defaults");
    assert_eq!(
        (tool.to_string(), reasoning.to_string()),
        ("auto".into(), "auto".into())
    );
    let router = "router: {http: \"127.0.0.1:1\", grpc: \"127.0.0.1:2\", \
                  tool_call_parser: mistral, reasoning_parser: none}\n";
    let text = format!("mesh: {{insecure_no_mesh_auth: true}}\n{router}{NODES}");
    let cfg = parse(&text).expect("valid");
    let (tool, reasoning) = cfg.router.parsers(&cfg.file).expect("named");
    assert_eq!(
        (tool.to_string(), reasoning.to_string()),
        ("mistral".into(), "none".into())
    );
    for (field, value, want) in [
        (
            "tool_call_parser",
            "pythonic",
            "router.tool_call_parser = \"pythonic\": expected one of auto, hermes, llama3_json, mistral",
        ),
        (
            "reasoning_parser",
            "granite",
            "router.reasoning_parser = \"granite\": expected one of auto, none, qwen3, deepseek_r1",
        ),
    ] {
        let router = format!(
            "router: {{http: \"127.0.0.1:1\", grpc: \"127.0.0.1:2\", {field}: {value}}}\n"
        );
        let e = refused(&format!("mesh: {{insecure_no_mesh_auth: true}}\n{router}{NODES}"));
        assert!(e.contains(want), "{want:?} not in {e}");
    }
}

#[test]
fn activations_are_one_per_mesh_and_checked() {
    use kvmesh_kernels::cpu::Activations;
    let cfg = parse(&format!("{BASE}{NODES}")).expect("valid");
    assert_eq!(cfg.activations().expect("valid"), Activations::default());
    let cfg = parse(&format!("{BASE}{NODES}activations: int8\n")).expect("valid");
    assert_eq!(cfg.activations().expect("valid"), Activations::Int8);
    let e = refused(&format!("{BASE}{NODES}activations: int4\n"));
    assert!(
        e.contains(
            "activations = \"int4\": unknown activation class \"int4\": expected f32 or int8"
        ),
        "{e}"
    );
    // Not a node setting: the class is the mesh's numerics.
    let e = refused(&format!(
        "{BASE}prefill: [{{name: p, grpc: \"127.0.0.1:3\", activations: int8}}]\n\
         decode: [{{name: d, grpc: \"127.0.0.1:4\", kv: \"127.0.0.1:5\"}}]\n"
    ));
    assert!(e.contains("activations"), "{e}");
}

#[test]
fn api_key_scopes_are_checked_naming_the_key_by_position() {
    let keyed = |scopes: &str| {
        format!(
            "mesh: {{insecure_no_mesh_auth: true}}\n\
             router: {{http: \"127.0.0.1:1\", grpc: \"127.0.0.1:2\", api_keys: [{{key: sk-1, tenant: a}}, {{key: sk-2, tenant: ops{scopes}}}]}}\n{NODES}"
        )
    };
    let cfg = parse(&keyed(", scopes: [metrics]")).expect("valid");
    let scopes = cfg.router.api_keys[1]
        .parsed_scopes(1, Path::new("/t/mesh.yaml"))
        .expect("scopes");
    assert_eq!(scopes, [kvmesh_router::auth::Scope::Metrics]);
    assert_eq!(
        cfg.router.api_keys[0]
            .parsed_scopes(0, Path::new("/t/mesh.yaml"))
            .expect("default"),
        [kvmesh_router::auth::Scope::Inference]
    );
    let e = refused(&keyed(", scopes: [admin]"));
    assert!(
        e.contains("router.api_keys[1].scopes = \"admin\": unknown scope"),
        "{e}"
    );
    assert!(!e.contains("sk-2"), "the key is a secret: {e}");
}

#[test]
fn admission_and_each_keys_share_are_read_and_checked_naming_the_field() {
    use kvmesh_router::admission::{Policy, Share};
    use kvmesh_router::auth::Tenant;
    let file = Path::new("/t/mesh.yaml");
    let with = |router: &str| {
        format!(
            "mesh: {{insecure_no_mesh_auth: true}}\n\
             router: {{http: \"127.0.0.1:1\", grpc: \"127.0.0.1:2\"{router}}}\n{NODES}"
        )
    };
    let cfg = parse(&with("")).expect("valid");
    let (policy, shares) = cfg.router.admission(file).expect("defaults");
    assert_eq!(policy, Policy::Fair);
    assert_eq!(shares.of(&Tenant("a".into())), Share::default());
    let cfg = parse(&with(
        ", admission: fifo, api_keys: [{key: sk-1, tenant: a, weight: 2, max_running: 8, \
         max_queued_tokens: 4096}, {key: sk-2, tenant: a, weight: 2, max_running: 8, \
         max_queued_tokens: 4096}, {key: sk-3, tenant: b}]",
    ))
    .expect("valid");
    let (policy, shares) = cfg.router.admission(file).expect("parsed");
    assert_eq!(policy, Policy::Fifo);
    assert_eq!(
        shares.of(&Tenant("a".into())),
        Share::parse_fields("weight=2:max_running=8:max_queued_tokens=4096").expect("share")
    );
    assert_eq!(shares.of(&Tenant("b".into())), Share::default());
    let cfg = parse(&with(
        ", default_share: {max_running: 48}, api_keys: [{key: sk-1, tenant: a, weight: 2}]",
    ))
    .expect("valid");
    let (_, shares) = cfg.router.admission(file).expect("parsed");
    assert_eq!(
        shares.of(&Tenant("z".into())),
        Share::parse_fields("max_running=48").expect("share")
    );
    assert_eq!(
        shares.of(&Tenant("a".into())),
        Share::parse_fields("weight=2:max_running=48").expect("share"),
        "a key's own fields over the default's"
    );
    for (router, says) in [
        (
            ", admission: lifo",
            "router.admission = \"lifo\": unknown admission policy",
        ),
        (
            ", api_keys: [{key: sk-1, tenant: a, weight: 0}]",
            "router.api_keys[0].weight = \"0\": must be at least 1",
        ),
        (
            ", api_keys: [{key: sk-1, tenant: a, max_running: 0}]",
            "router.api_keys[0].max_running = \"0\": must be at least 1",
        ),
        (
            ", default_share: {max_running: 0}",
            "router.default_share.max_running = \"0\": must be at least 1",
        ),
        (
            ", admission: fifo, reserve: 2",
            "router.reserve = \"2\": fair admission's; admission: fifo keeps no slot back",
        ),
        (
            ", max_running: 16, reserve: 16",
            "router.reserve = \"16\": must be under router.max_running (16)",
        ),
        (
            ", api_keys: [{key: sk-1, tenant: a}, {key: sk-2, tenant: a, weight: 3}]",
            "router.api_keys[1] = \"a\": tenant \"a\" is given two different limits",
        ),
    ] {
        let e = refused(&with(router));
        assert!(e.contains(says), "{router}: {e}");
        assert!(!e.contains("sk-"), "the key is a secret: {e}");
    }
}
