use super::*;

fn keys() -> CacheKeys {
    CacheKeys::new(&MeshSecret::generate().expect("secret"))
}

fn model() -> ModelTag {
    ModelTag::new("smollm2-q4_1", &[("n_layers", 30), ("page_size", 16)])
}

#[test]
fn namespaces_are_length_prefixed_and_salts_only_narrow() {
    let k = keys();
    // Naive concatenation would make these equal.
    assert_ne!(
        k.namespace("org_1", Some("2345")),
        k.namespace("org_12345", Some(""))
    );
    assert_ne!(
        k.namespace("org_12345", None),
        k.namespace("org_12345", Some(""))
    );
    // A salt never reaches another tenant's namespace, salted or not.
    assert_ne!(k.namespace("a", Some("s")), k.namespace("b", Some("s")));
    assert_ne!(k.namespace("a", Some("s")), k.namespace("a", None));
    // Deterministic: the gateway and every node agree.
    assert_eq!(k.namespace("a", Some("s")), k.namespace("a", Some("s")));
}

#[test]
fn keys_depend_on_the_secret_namespace_model_and_whole_prefix() {
    let (k, other) = (keys(), keys());
    let ns = k.namespace("a", None);
    let m = model();
    let tokens: Vec<u32> = (0..64).collect();
    let base = k.page_keys(&ns, &m, 16, &tokens);
    assert_eq!(base.len(), 4);
    // Another mesh's secret: other keys for the same namespace name.
    assert_ne!(
        other.page_keys(&other.namespace("a", None), &m, 16, &tokens),
        base
    );
    // Another tenant.
    let nb = k.namespace("b", None);
    let b = k.page_keys(&nb, &m, 16, &tokens);
    assert!(base.iter().zip(&b).all(|(x, y)| x != y));
    // Another model or geometry.
    let m2 = ModelTag::new("smollm2-q4_1", &[("n_layers", 30), ("page_size", 32)]);
    assert_ne!(k.page_keys(&ns, &m2, 16, &tokens)[0], base[0]);
    // One token changed in page 1: page 0 keeps its key, every later page
    // changes (a key names the whole prefix).
    let mut t2 = tokens.clone();
    t2[20] += 1;
    let changed = k.page_keys(&ns, &m, 16, &t2);
    assert_eq!(changed[0], base[0]);
    assert!(changed[1..].iter().zip(&base[1..]).all(|(x, y)| x != y));
    // The same page's tokens after another parent: another key.
    assert_ne!(k.page_key(&ns, &m, None, &tokens[16..32]), base[1]);
}

#[test]
fn only_full_pages_have_keys() {
    let k = keys();
    let ns = k.namespace("a", None);
    let tokens: Vec<u32> = (0..47).collect();
    assert_eq!(k.page_keys(&ns, &model(), 16, &tokens).len(), 2);
    assert!(k.page_keys(&ns, &model(), 16, &tokens[..15]).is_empty());
    assert!(k.page_keys(&ns, &model(), 0, &tokens).is_empty());
    // A prefix's keys are a prefix of the longer sequence's.
    let long = k.page_keys(&ns, &model(), 16, &tokens);
    assert_eq!(k.page_keys(&ns, &model(), 16, &tokens[..32]), long);
}

#[test]
fn debug_shows_no_key_material() {
    let k = keys();
    let shown = format!("{k:?}");
    assert!(shown.contains("<redacted>"), "{shown}");
    let ns = format!("{:?}", k.namespace("tenant-name", None));
    assert!(
        ns.starts_with("Namespace(") && !ns.contains("tenant"),
        "{ns}"
    );
    let raw = k.namespace("a", None);
    assert_eq!(Namespace::from_slice(raw.as_bytes()), Some(raw));
    assert_eq!(Namespace::from_slice(&[0; 31]), None);
}

#[test]
fn a_routing_id_is_the_keys_first_eight_bytes() {
    let k = keys().page_key(&keys().namespace("t", None), &model(), None, &[1, 2, 3]);
    let mut b = [0; 8];
    b.copy_from_slice(&k.as_bytes()[..8]);
    assert_eq!(k.routing_id(), u64::from_le_bytes(b));
    let other = keys().page_key(&keys().namespace("u", None), &model(), None, &[1, 2, 3]);
    assert_ne!(k.routing_id(), other.routing_id());
}
