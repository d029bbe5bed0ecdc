//! The planted bug `cache-no-namespace` (testing builds): the gateway
//! derives every tenant's cache namespace alike, as a salt plumbing bug
//! would. The isolation scenario of `prefix_cache.rs` must see it: tenant
//! B's request is served from tenant A's pages. A test binary of its own:
//! a planted bug holds for the whole process.

use kvmesh_faults::PlantedBug;
use kvmesh_integration::cache::isolation;
use kvmesh_integration::inproc::{InProcessMesh, Options};
use kvmesh_integration::tiny_model_dir;

#[test]
fn dropping_the_tenant_from_the_namespace_is_caught() {
    kvmesh_faults::plant(PlantedBug::CacheNoNamespace).expect("a testing build");
    let m = InProcessMesh::start(
        &tiny_model_dir(),
        Options {
            api_keys: vec![
                ("sk-alpha".into(), "alpha".into()),
                ("sk-beta".into(), "beta".into()),
            ],
            ..Options::default()
        },
    )
    .expect("mesh");
    let prompt = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. \
                  A stitch in time saves nine. The early bird catches the worm.";
    let iso = isolation(&m.http, "sk-alpha", "sk-beta", prompt, 4);
    assert!(iso.a_repeat > 0, "{iso:?}");
    // What the isolation test requires to be 0 is not: the leak is seen.
    assert_eq!(
        iso.b_same, iso.a_repeat,
        "the planted leak must show: {iso:?}"
    );
    assert!(iso.b_salted > 0, "{iso:?}");
    m.shutdown().expect("drains");
}
