#!/usr/bin/env bash
# The compose files run for real, as an operator runs them (issue 36, item
# 1; docs/containers.md says what is checked and what is not):
#
# 1. installs what it needs from Debian's packages when missing (docker.io,
#    docker-compose, debootstrap) and starts dockerd if none answers (and
#    stops it again at the end);
# 2. builds every image offline: a Debian bookworm base with debootstrap
#    (cached as a tarball under $KVMESH_HOME/compose-check, made once), an
#    image holding the kvmesh binary built on the host and the default
#    model, then the repository's Dockerfile and deploy/etcd/Dockerfile with
#    those as their base images (build arguments; their `build` stage, which
#    compiles kvmesh in a Rust image, is not run);
# 3. runs scripts/compose_check.py: docker-compose.yml (with a second decode
#    node) and docker-compose.etcd.yml (over TLS, with the certificates the
#    binary's `kvmesh certs` makes as the file's header says) up, golden
#    prompts, `docker kill` of a decode container mid-stream, its restart,
#    and `down` draining; that the etcd variant's etcd refuses plaintext and
#    a certificate of another CA; the GPU compose file up to the device;
# 4. removes every container, network, volume, image and build-cache entry
#    it made, on failure too, and puts back any kvmesh:latest, kvmesh:cuda
#    or kvmesh-etcd:latest image that was there before.
#
# Prints what it checked; exits 0 only when all of it held. Bounded:
# KVMESH_COMPOSE_CHECK_TIMEOUT seconds for the checks (default 900), and a
# bound on each install and build step. Needs root (re-runs itself with
# sudo). The binary: KVMESH_BIN, else ${CARGO_TARGET_DIR:-target}/debug/kvmesh
# (what scripts/test.sh builds; built here if missing).
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "==> compose-check: $*"; }
fail() {
  say "FAILED: $*"
  exit 1
}

if [ "$(id -u)" != 0 ]; then
  exec sudo --preserve-env bash "$PWD/scripts/compose-check.sh" "$@"
fi

T0=$(date +%s)
KVMESH_HOME="${KVMESH_HOME:-$HOME/.cache/kvmesh}"
CHECK_TIMEOUT="${KVMESH_COMPOSE_CHECK_TIMEOUT:-900}"

install_package() {
  say "installing Debian's $1 (for $2)"
  env DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y --no-install-recommends "$1" \
    || { timeout 300 apt-get update -q \
      && env DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y --no-install-recommends "$1"; }
}
[ -x /usr/sbin/dockerd ] || install_package docker.io "the container engine"
command -v docker-compose >/dev/null 2>&1 || install_package docker-compose "the compose files"
[ -x /usr/sbin/debootstrap ] || install_package debootstrap "the offline base image"
# Debian's client, when there: it matches Debian's engine and has BuildKit
# built in (a newer client without the buildx plugin refuses BuildKit).
DOCKER=docker
[ -x /usr/bin/docker ] && DOCKER=/usr/bin/docker
say "$($DOCKER --version); $(docker-compose version --short 2>/dev/null | sed 's/^/docker-compose /')"

# One check at a time on a machine: the image names the compose files use
# (kvmesh:latest, ...) are shared.
exec 9>/run/lock/kvmesh-compose-check.lock
flock -w 1200 9 || fail "another compose-check held the lock for 20 minutes"

WORK=$(mktemp -d /var/tmp/kvmesh-compose-check.XXXXXX)
RUN=$(printf '%04x%04x' "$RANDOM" "$RANDOM")
NAME="kvmeshcheck${RUN}"
BASE="kvmesh-check-base:$RUN"
ARTIFACTS="kvmesh-check-artifacts:$RUN"
OURS=(kvmesh:latest kvmesh:cuda kvmesh-etcd:latest)
DOCKERD_PID=""
cache_ids() {
  $DOCKER system df -v --format '{{json .BuildCache}}' 2>/dev/null \
    | python3 -c 'import json,sys; [print(c["ID"]) for c in (json.load(sys.stdin) or [])]' || true
}

cleanup() {
  local rc=$?
  set +e
  say "cleaning up (containers, networks, volumes, images and build cache of this run)"
  for p in "${NAME}gpu" "${NAME}static" "${NAME}etcd"; do
    $DOCKER ps -aq --filter "label=com.docker.compose.project=$p" | xargs -r $DOCKER rm -f >/dev/null
    $DOCKER network ls -q --filter "label=com.docker.compose.project=$p" | xargs -r $DOCKER network rm >/dev/null
    $DOCKER volume ls -q --filter "label=com.docker.compose.project=$p" | xargs -r $DOCKER volume rm >/dev/null
  done
  for t in "${OURS[@]}" "$ARTIFACTS" "$BASE"; do
    $DOCKER image inspect "$t" >/dev/null 2>&1 && $DOCKER rmi "$t" >/dev/null
  done
  for t in "${OURS[@]}"; do
    local saved="kvmesh-check-saved/${t/:/-}:$RUN"
    if $DOCKER image inspect "$saved" >/dev/null 2>&1; then
      $DOCKER tag "$saved" "$t" && $DOCKER rmi "$saved" >/dev/null && say "put back the earlier $t"
    fi
  done
  # Build-cache entries this run made (an entry goes only once nothing
  # made from it is left, hence the passes).
  if [ -f "$WORK/cache-before" ]; then
    for _ in 1 2 3 4 5; do
      cache_ids | sort | comm -13 "$WORK/cache-before" - >"$WORK/cache-new"
      [ -s "$WORK/cache-new" ] || break
      while read -r id; do
        $DOCKER builder prune -f --filter "id=$id" >/dev/null
      done <"$WORK/cache-new"
    done
  fi
  if [ -n "$DOCKERD_PID" ]; then
    say "stopping the dockerd this check started"
    kill "$DOCKERD_PID"
    timeout 30 tail --pid="$DOCKERD_PID" -f /dev/null
  fi
  rm -rf "$WORK"
  say "took $(($(date +%s) - T0)) s in all"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if ! timeout 20 $DOCKER info >/dev/null 2>&1; then
  say "starting dockerd (log: /var/log/kvmesh-compose-check-dockerd.log)"
  nohup /usr/sbin/dockerd >/var/log/kvmesh-compose-check-dockerd.log 2>&1 &
  DOCKERD_PID=$!
  for _ in $(seq 60); do
    timeout 5 $DOCKER info >/dev/null 2>&1 && break
    kill -0 "$DOCKERD_PID" 2>/dev/null || fail "dockerd exited: $(tail -5 /var/log/kvmesh-compose-check-dockerd.log)"
    sleep 1
  done
  timeout 5 $DOCKER info >/dev/null 2>&1 || fail "dockerd did not answer within 60 s"
fi
say "engine: $($DOCKER info --format '{{.ServerVersion}}, {{.Driver}}, cgroup v{{.CgroupVersion}}')"

# The binary and the model the image carries.
BIN="${KVMESH_BIN:-${CARGO_TARGET_DIR:-target}/debug/kvmesh}"
if [ ! -x "$BIN" ]; then
  [ -z "${KVMESH_BIN:-}" ] || fail "KVMESH_BIN=$BIN is not an executable"
  say "no $BIN: building it (cargo build -p kvmesh-cli)"
  cargo build -p kvmesh-cli
fi
MODEL_IN_IMAGE=$(sed -n 's/^model:[[:space:]]*//p' deploy/mesh.yaml)
MODEL="$KVMESH_HOME/$(basename "$MODEL_IN_IMAGE")"
if [ ! -f "$MODEL" ]; then
  say "fetching the default model into $KVMESH_HOME"
  KVMESH_HOME="$KVMESH_HOME" "$BIN" fetch-model
fi
[ -f "$MODEL" ] || fail "no $MODEL (the model deploy/mesh.yaml names)"
say "binary: $BIN ($("$BIN" --version 2>/dev/null | head -1)); model: $MODEL"

for t in "${OURS[@]}"; do
  if $DOCKER image inspect "$t" >/dev/null 2>&1; then
    say "setting aside the existing $t until the end"
    $DOCKER tag "$t" "kvmesh-check-saved/${t/:/-}:$RUN"
  fi
done
cache_ids | sort >"$WORK/cache-before"

# The Debian bookworm base (the Dockerfiles' default bases are bookworm),
# from the mirror apt uses here. Made once; remove the tarball to remake it.
TARBALL="$KVMESH_HOME/compose-check/bookworm-minbase.tar.gz"
if [ ! -f "$TARBALL" ]; then
  MIRROR="${KVMESH_DEBIAN_MIRROR:-$(sed -n 's/^URIs:[[:space:]]*//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | grep -v security | head -1)}"
  [ -n "$MIRROR" ] || MIRROR=$(awk '$1 == "deb" && $3 == "bookworm" {print $2; exit}' /etc/apt/sources.list 2>/dev/null)
  [ -n "$MIRROR" ] || fail "no Debian mirror found in apt's sources; set KVMESH_DEBIAN_MIRROR"
  say "making the base image's root file system with debootstrap (bookworm, minbase; once)"
  t=$(date +%s)
  timeout 900 debootstrap --variant=minbase bookworm "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
    || fail "debootstrap: $(tail -5 "$WORK/debootstrap.log")"
  rm -rf "$WORK"/rootfs/var/lib/apt/lists/* "$WORK"/rootfs/var/cache/apt/*.bin "$WORK"/rootfs/var/cache/apt/archives/*.deb
  mkdir -p "$(dirname "$TARBALL")"
  tar -C "$WORK/rootfs" -czf "$TARBALL.part" . && mv "$TARBALL.part" "$TARBALL"
  rm -rf "$WORK/rootfs"
  say "debootstrap took $(($(date +%s) - t)) s; kept as $TARBALL"
fi
t=$(date +%s)
$DOCKER import "$TARBALL" "$BASE" >/dev/null
# What the Dockerfile's `build` stage would hold, at its paths: the host's
# binary, the model, and no CUDA libraries.
mkdir -p "$WORK/artifacts/src/target/release" "$WORK/artifacts/models" "$WORK/artifacts/cuda/lib"
cp "$BIN" "$WORK/artifacts/src/target/release/kvmesh"
ln "$MODEL" "$WORK/artifacts$MODEL_IN_IMAGE" 2>/dev/null || cp "$MODEL" "$WORK/artifacts$MODEL_IN_IMAGE"
tar -C "$WORK/artifacts" -cf - . | $DOCKER import - "$ARTIFACTS" >/dev/null
rm -rf "$WORK/artifacts"
say "building kvmesh:latest from the Dockerfile (RUNTIME_BASE=$BASE, KVMESH_FROM=$ARTIFACTS)"
DOCKER_BUILDKIT=1 timeout 600 $DOCKER build -q -t kvmesh:latest \
  --build-arg "RUNTIME_BASE=$BASE" --build-arg "KVMESH_FROM=$ARTIFACTS" . >"$WORK/build.log" 2>&1 \
  || fail "docker build: $(tail -20 "$WORK/build.log")"
say "building kvmesh-etcd:latest from deploy/etcd/Dockerfile (BASE=$BASE)"
DOCKER_BUILDKIT=1 timeout 600 $DOCKER build -q -t kvmesh-etcd:latest \
  --build-arg "BASE=$BASE" deploy/etcd >"$WORK/build-etcd.log" 2>&1 \
  || fail "docker build deploy/etcd: $(tail -20 "$WORK/build-etcd.log")"
# docker-compose.gpu.yml names kvmesh:cuda (the Dockerfile with CUDA=1,
# whose NVRTC and cuBLAS wheels this check does not fetch): the CPU image
# stands in for creating its containers, which is as far as it goes here.
$DOCKER tag kvmesh:latest kvmesh:cuda
say "images built in $(($(date +%s) - t)) s; $($DOCKER run --rm kvmesh:latest --version | head -1) in the image"

# The checks run on copies of the compose and mesh files, with a fresh
# mesh secret and fresh certificates: the operator's tree (and any
# deploy/mesh.secret or deploy/certs) is not touched.
mkdir -p "$WORK/project/deploy"
cp docker-compose.yml docker-compose.etcd.yml docker-compose.gpu.yml "$WORK/project/"
cp -r deploy/mesh.yaml deploy/mesh-etcd.yaml deploy/mesh-gpu.yaml deploy/etcd "$WORK/project/deploy/"
head -c 32 /dev/urandom >"$WORK/project/deploy/mesh.secret"
chown 10001 "$WORK/project/deploy/mesh.secret"
chmod 400 "$WORK/project/deploy/mesh.secret"
# The etcd variant's CA and certificates, made as docker-compose.etcd.yml's
# header says (its `kvmesh certs` command, run with $BIN), each key given to
# the uid its container runs as (etcd's image 10002, kvmesh's 10001), 0600.
mapfile -t CERT_ARGS < <(python3 scripts/compose_check.py --certs-args docker-compose.etcd.yml)
[ "${#CERT_ARGS[@]}" -gt 2 ] || fail "docker-compose.etcd.yml's header has no 'kvmesh certs' command"
CERTS="$WORK/project/deploy/certs"
"$BIN" certs "${CERT_ARGS[@]}" --out "$CERTS" >"$WORK/certs.log" 2>&1 \
  || fail "kvmesh certs ${CERT_ARGS[*]}: $(tail -5 "$WORK/certs.log")"
for key in "$CERTS"/*-key.pem; do
  case "$(basename "$key")" in
    ca-key.pem) ;;
    etcd-key.pem) chown 10002 "$key" ;;
    *) chown 10001 "$key" ;;
  esac
done
say "certificates by kvmesh certs: $(cd "$CERTS" && echo *.pem)"

say "running the checks (bounded: $CHECK_TIMEOUT s)"
timeout --kill-after=30 "$CHECK_TIMEOUT" python3 scripts/compose_check.py \
  --project "$WORK/project" --name "$NAME" --kvmesh "$BIN" --model "$MODEL" \
  --docker "$DOCKER" --compose docker-compose \
  || fail "a container check did not hold (see above)"
say "all checks held; the image ran the binary $BIN"
