#!/usr/bin/env bash
# Hosts with their own network (issue 36 item 2), end to end: etcd, the
# router, 2 prefill and 2 decode nodes, each a real process in a network
# namespace of its own, joined by links that are shaped and cut
# (integration/src/netlab; `tc netem` where the kernel has it, else the
# lab's userspace switch over TUN devices). For tcp and ucx, each with
# mutual TLS off and on, it checks (integration/tests/netns/):
#   - 2 ms +- 0.5 ms and 0.5% loss on every link: outputs equal
#     `kvmesh generate`, every page back, every grant ended once;
#   - 100 Mbit/s links: KV bytes per prompt token equal the pool geometry;
#     transfer time at the link rate and TTFT reported;
#   - a decode host cut mid-transfer for 10 s: its stream ends with a typed
#     error within lease + abort timeout, the router stops choosing it, its
#     etcd lease expires, its grant ends revoked (never completed), and it
#     rejoins (etcd, routing, traffic) as the same process;
#   - a prefill host cut mid-transfer for 10 s: the client gets a typed
#     error or the right answer, the decode node ends the grant only by a
#     revocation or a confirmed abort, and the prefill host rejoins.
# Prints what it checked; exits 0 only if all of it held. Needs root.
#
#   bash scripts/netns-check.sh                 # everything (~4-6 min after the build)
#   KVMESH_NETNS_TESTS=tcp bash scripts/netns-check.sh   # a filter on the test names
#   KVMESH_NETLAB_LINKS=veth|switch             # force a link mechanism
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "==> netns-check: $*"; }

if [ "$(id -u)" != 0 ]; then
  say "FAILED: needs root (network namespaces, TUN or veth devices)"
  exit 1
fi
apt_install() {
  say "installing Debian's $1"
  env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$1" \
    || { apt-get update -q && env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$1"; }
}
command -v ip >/dev/null && command -v tc >/dev/null || apt_install iproute2
if [ -z "${KVMESH_ETCD:-}" ] && ! command -v etcd >/dev/null 2>&1; then
  apt_install etcd-server
fi
/sbin/ldconfig -p | grep -q 'libucp\.so\.0 ' || apt_install libucx0
# A container may lack the TUN device node though its kernel has TUN.
if [ ! -e /dev/net/tun ]; then
  mkdir -p /dev/net && mknod /dev/net/tun c 10 200
fi

# Whatever a run killed before its cleanup left (namespaces named
# kvmesh-lab-PID-..., of processes that are gone) is swept by the next lab;
# this sweeps after this run too, even if it is interrupted.
sweep() {
  for ns in $(ip netns list 2>/dev/null | awk '/^kvmesh-lab-/ {print $1}'); do
    pid=${ns#kvmesh-lab-}
    pid=${pid%%-*}
    if [ ! -e "/proc/$pid" ]; then
      for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
      ip netns del "$ns" 2>/dev/null || true
    fi
  done
}
trap sweep EXIT

# The same build as scripts/test.sh's (a no-op after it), so the test
# binaries and the `kvmesh` they start agree; `cargo test --workspace`
# below keeps its feature set too (a `-p` build would rebuild shared
# crates with another one).
say "building (cargo build --workspace --all-targets)"
cargo build --workspace --all-targets

log=$(mktemp)
started=$(date +%s)
say "running the lab tests one at a time (each bounds itself to 5 min; all to ${KVMESH_NETNS_TIMEOUT_S:-1500} s)"
set +e
timeout --kill-after=20 "${KVMESH_NETNS_TIMEOUT_S:-1500}" \
  cargo test --workspace --test netns -- --ignored --test-threads=1 --nocapture \
  ${KVMESH_NETNS_TESTS:-} 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
elapsed=$(( $(date +%s) - started ))

echo
say "what was checked:"
# (--nocapture puts a test's first output on its `test NAME ...` line.)
grep -oE 'CHECKED.*' "$log" | sed 's/^/  /' || true
grep -E '^test result:' "$log" | sed 's/^/  /' || true
passed=$(sed -nE 's/^test result: ok\. ([0-9]+) passed.*/\1/p' "$log" | tail -1)
passed=${passed:-0}
# Without a filter all five tests must have run (a test that was not run
# checked nothing).
want=1
[ -z "${KVMESH_NETNS_TESTS:-}" ] && want=5
if [ "$rc" = 0 ] && [ "$passed" -ge "$want" ]; then
  say "all held: $passed tests passed in ${elapsed} s"
  rm -f "$log"
  exit 0
fi
say "FAILED (exit $rc after ${elapsed} s; full log: $log)"
grep -E '^FAILED|panicked' "$log" | sed 's/^/  /' || true
exit 1
