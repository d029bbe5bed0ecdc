#!/usr/bin/env python3
"""The compose files run as an operator runs them (issue 36, item 1).

Called by scripts/compose-check.sh, which installs the engine and compose,
builds the images offline and cleans up; this file holds the checks, on a
project folder that holds copies of the repository's compose files and
deploy/ mesh files plus a fresh mesh secret (the operator's tree is never
written). For docker-compose.yml (with a second decode node added by an
override file, derived from decode-0's definition) and for
docker-compose.etcd.yml (whose second decode node is its `more` profile):

  1. up: every kvmesh service runs kvmesh as PID 1, the router's /health
     answers 200 and its metrics show both decode nodes up;
  2. the golden prompts (integration/tests/mesh.rs's, completion and chat,
     streamed and not) through the router's published port equal
     `kvmesh generate` on the same model file, greedy;
  3. `docker kill` of the decode container serving one of two streams: that
     stream ends with a typed error event (decode_failed) at once, the other
     stream finishes whole, the router marks the node down, and new requests
     are answered by the other decode node and equal the reference;
  4. the killed container, started again, is marked up and takes new
     requests (its granted reservations rise), equal to the reference;
  5. `down` with a stream in flight: the stream finishes, equal to the
     reference; every container exits 0 within the drain bound (the mesh
     file's drain_timeout_ms); each node's drain line reports 0
     reservations open and 0 pages in use.

For docker-compose.etcd.yml, also that it runs inside TLS: every node's
`--check-config` in its container says mutual TLS and etcd over https with
a client certificate; a plaintext HTTP request from the router's container
to etcd:2379 gets no answer from etcd; and a decode node whose etcd client
certificate is of another CA (trusting the mesh's CA, so only etcd's
refusal can stop it) cannot register and exits, and etcd logs that it
refused the certificate.

And for docker-compose.gpu.yml, up to the device: `config` accepts it, and
the containers `up --no-start` creates carry the NVIDIA device reservations
(driver, device ids, capabilities) in the engine's container config. No GPU
is here, so no container of it is started.

Standard library and PyYAML (a dependency of Debian's docker-compose). Exits
1 at the first check that does not hold, naming it.
"""

import argparse
import copy
import json
import os
import re
import shlex
import subprocess
import sys
import time

import yaml

from mesh_client import Failed, Stream, check, complete, granted, node_up, try_get

# integration/tests/mesh.rs's PROMPTS.
PROMPTS = [
    "Hello world",
    "The capital of France is",
    "Once upon a time",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "Le chat est",
    "¿Dónde está la biblioteca?",
    "日本語のテキスト",
    "A",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown fox",
    "emoji 😀🎉 and more",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
]
MAX_TOKENS = 24
# Long enough that a stream is still running when its node is killed.
LONG_TOKENS = 240
# A killed node's stream must end within this ("at once": the router sees
# the connection drop; the rest is scheduling on a loaded machine).
KILL_BOUND_S = 5.0
# Bound on any other wait (startup, a node marked up or down).
WAIT_S = 60.0


def ok(msg):
    print(f"==> compose-check: ok: {msg}", flush=True)


def note(msg):
    print(f"==> compose-check: {msg}", flush=True)


def wait_for(what, cond, bound=WAIT_S, every=0.2):
    """Polls `cond` until it returns a truthy value; fails after `bound` s."""
    t0 = time.monotonic()
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() - t0 > bound:
            raise Failed(f"{what}: not within {bound:.0f} s")
        time.sleep(every)


# ------------------------------------------------------------- reference


class Reference:
    """`kvmesh generate`'s greedy text, as the integration tests take it."""

    def __init__(self, kvmesh, model):
        self.kvmesh, self.model, self.memo = kvmesh, model, {}

    def text(self, prompt, chat, max_tokens):
        key = (prompt, chat, max_tokens)
        if key not in self.memo:
            args = [self.kvmesh, "generate", "--model", self.model, "--prompt", prompt,
                    "--max-tokens", str(max_tokens), "--temperature", "0"]
            if chat:
                args.append("--chat")
            out = subprocess.run(args, capture_output=True, timeout=300)
            check(out.returncode == 0, f"kvmesh generate failed: {out.stderr.decode()[-2000:]}")
            t = out.stdout.decode()
            self.memo[key] = t[:-1] if t.endswith("\n") else t
        return self.memo[key]


# --------------------------------------------------------------- compose


class Project:
    """One compose project (`-p name`) over compose files in `folder`."""

    def __init__(self, args, name, files, env=None, profiles=()):
        self.a, self.name, self.files, self.profiles = args, name, files, profiles
        self.env = dict(os.environ, **(env or {}))

    def compose(self, *argv, timeout=300, check_rc=True):
        cmd = [self.a.compose, "-p", self.name]
        for f in self.files:
            cmd += ["-f", f]
        for p in self.profiles:
            cmd += ["--profile", p]
        out = subprocess.run(cmd + list(argv), cwd=self.a.project, env=self.env,
                             capture_output=True, text=True, timeout=timeout)
        if check_rc:
            check(out.returncode == 0,
                  f"{' '.join(cmd[3:] + list(argv))}: exit {out.returncode}: {out.stderr[-3000:]}")
        return out

    def container(self, service):
        cid = self.compose("ps", "-q", service).stdout.strip()
        check(cid, f"{self.name}: no container for {service}")
        return cid

    def docker(self, *argv, timeout=120):
        return subprocess.run([self.a.docker, *argv], capture_output=True, text=True,
                              timeout=timeout)

    def inspect(self, cid):
        out = self.docker("inspect", cid)
        check(out.returncode == 0, f"docker inspect {cid}: {out.stderr}")
        return json.loads(out.stdout)[0]

    def http_port(self):
        out = self.compose("port", "router", "8080").stdout.strip()
        m = re.search(r":(\d+)$", out)
        check(m, f"router's published port: {out!r}")
        return int(m.group(1))

    def logs(self, service):
        return self.compose("logs", "--no-color", service, check_rc=False).stdout

    def down(self):
        self.compose("down", "-v", "--remove-orphans", timeout=120, check_rc=False)


def kvmesh_services(project):
    config = yaml.safe_load(project.compose("config").stdout)
    return [s for s, d in config["services"].items() if str(d.get("image", "")).startswith("kvmesh:")]


def drain_bound_s(mesh_file):
    m = re.search(r"^drain_timeout_ms:\s*(\d+)", open(mesh_file).read(), re.M)
    check(m, f"{mesh_file}: no drain_timeout_ms")
    return int(m.group(1)) / 1000


# ---------------------------------------------------------------- checks


def check_up(p, decodes):
    t0 = time.monotonic()
    p.compose("up", "-d", "--no-build", timeout=300)
    port = p.http_port()
    for s in kvmesh_services(p):
        cid = p.container(s)
        out = p.docker("exec", cid, "cat", "/proc/1/cmdline")
        argv = out.stdout.split("\0")
        check(out.returncode == 0 and os.path.basename(argv[0]) == "kvmesh",
              f"{s}: PID 1 is {argv[:2]!r}, not kvmesh ({out.stderr.strip()})")
    wait_for(f"{p.name}: the router's /health answers 200",
             lambda: try_get(port, "/health")[0] == 200)
    for d in decodes:
        wait_for(f"{p.name}: {d} up in the router's metrics", lambda d=d: node_up(port, d))
    ok(f"{p.name}: up in {time.monotonic() - t0:.1f} s: /health 200 on the published port {port}, "
       f"{' and '.join(decodes)} up, kvmesh is PID 1 in every kvmesh container")
    return port


def check_golden(p, port, ref):
    cases = 0
    for i, prompt in enumerate(PROMPTS):
        for chat in (False, True):
            stream = (i + int(chat)) % 2 == 0
            want = ref.text(prompt, chat, MAX_TOKENS)
            got, err = complete(port, prompt, chat, MAX_TOKENS, stream)
            check(err is None, f"{p.name}: prompt {prompt!r} chat={chat} stream={stream}: {err}")
            check(got == want, f"{p.name}: prompt {prompt!r} chat={chat} stream={stream}: "
                               f"mesh {got!r} != kvmesh generate {want!r}")
            cases += 1
    ok(f"{p.name}: {cases} golden requests (12 prompts, completion and chat, streamed and not) "
       f"through the published port equal `kvmesh generate`")


def serving_node(port, before, decodes):
    """The decode node whose granted count rose since `before`."""
    def rose():
        now = {d: granted(port, d) for d in decodes}
        up = [d for d in decodes if now[d] > before[d]]
        return (up[0], now) if len(up) == 1 else None
    return wait_for("a decode node granted the new stream", rose)


def check_kill_and_restart(p, port, ref, decodes):
    before = {d: granted(port, d) for d in decodes}
    a = Stream(port, "Once upon a time, in a land far away,", LONG_TOKENS, ignore_eos=True)
    check(a.first.wait(WAIT_S), "the first stream sent no event")
    node_a, before = serving_node(port, before, decodes)
    b = Stream(port, "In the beginning of the long winter,", LONG_TOKENS, ignore_eos=True)
    check(b.first.wait(WAIT_S), "the second stream sent no event")
    node_b, _ = serving_node(port, before, decodes)
    check(node_a != node_b, f"both streams went to {node_a}: the router did not spread them")
    check(a.end is None and b.end is None, f"a stream ended before the kill: {a.end} {b.end}")

    victim = p.container(node_a)
    # Timed from before the command: the stream may end before it returns.
    killed = time.monotonic()
    out = p.docker("kill", victim)
    check(out.returncode == 0, f"docker kill {node_a}: {out.stderr}")
    end_a = a.result()
    took = a.ended_at - killed
    check(end_a[0] == "error" and end_a[1] == "decode_failed",
          f"the killed node's stream ended as {end_a}, not with a decode_failed error event")
    check(node_a not in end_a[2], f"a node name reached the client: {end_a[2]}")
    check(took < KILL_BOUND_S, f"the killed node's stream took {took:.1f} s to end")
    ok(f"{p.name}: docker kill {node_a} mid-stream: its stream ended with a typed error "
       f"event (decode_failed) {took:.2f} s after `docker kill` was run")

    # New requests while it is down: answered, equal to the reference, by
    # the other node. One routed to the dead node before the router saw it
    # go may fail, but only fast and typed (as deploy.rs allows).
    fresh = ["The capital of France is", "def fibonacci(n):", "Le chat est", "Hello world"]
    served, t0 = 0, time.monotonic()
    g_b = granted(port, node_b)
    for prompt in fresh:
        t = time.monotonic()
        got, err = complete(port, prompt, False, MAX_TOKENS, False)
        if err is not None:
            code = json.loads(err)["error"]["code"] if err.startswith("{") else err
            check(code == "decode_failed" and time.monotonic() - t < KILL_BOUND_S,
                  f"{p.name}: while {node_a} is down: {err}")
            continue
        check(got == ref.text(prompt, False, MAX_TOKENS), f"{p.name}: {prompt!r} -> {got!r}")
        served += 1
    wait_for(f"the router marks {node_a} down", lambda: not node_up(port, node_a))
    for prompt in fresh[:2]:
        got, err = complete(port, prompt, True, MAX_TOKENS, True)
        check(err is None and got == ref.text(prompt, True, MAX_TOKENS),
              f"{p.name}: after {node_a} went down: {prompt!r}: {err or got!r}")
        served += 1
    wait_for(f"{node_b} counted the requests",
             lambda: granted(port, node_b) - g_b >= served, bound=10)
    end_b = b.result()
    check(end_b[0] == "finished" and end_b[3] == LONG_TOKENS,
          f"the other node's stream ended as {end_b[:3]}, not whole")
    ok(f"{p.name}: with {node_a} killed, {node_b}'s stream finished whole ({LONG_TOKENS} tokens), "
       f"the router marked {node_a} down, and {served} new requests were answered by {node_b}, "
       f"equal to `kvmesh generate` ({time.monotonic() - t0:.1f} s)")

    t0 = time.monotonic()
    p.compose("start", node_a)
    wait_for(f"the router marks the restarted {node_a} up", lambda: node_up(port, node_a))
    up_after = time.monotonic() - t0
    before = granted(port, node_a)
    took_traffic = False
    for prompt in ["Write a haiku about the sea.", "List three colours:", "Tell me a joke.",
                   "What is 2 + 2?", "Name a planet.", "The opposite of hot is"]:
        got, err = complete(port, prompt, False, MAX_TOKENS, False)
        check(err is None and got == ref.text(prompt, False, MAX_TOKENS),
              f"{p.name}: after the restart: {prompt!r}: {err or got!r}")
        try:
            wait_for("", lambda: granted(port, node_a) > before, bound=3)
            took_traffic = True
            break
        except Failed:
            pass
    check(took_traffic, f"the restarted {node_a} took none of 6 new requests")
    ok(f"{p.name}: {node_a} started again: marked up {up_after:.1f} s after `start`, "
       f"and it answered new requests, equal to `kvmesh generate`")


def check_down(p, port, ref, mesh_file):
    bound = drain_bound_s(mesh_file)
    services = p.compose("ps", "--services").stdout.split()
    ids = {s: p.container(s) for s in services}
    # Exit codes and logs outlive `down` (which removes the containers)
    # only if someone holds them: one `docker wait` and one `docker logs
    # -f` per container, from before the stop.
    waits = {s: subprocess.Popen([p.a.docker, "wait", c], stdout=subprocess.PIPE, text=True)
             for s, c in ids.items()}
    logs = {s: subprocess.Popen([p.a.docker, "logs", "-f", c], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace")
            for s, c in ids.items()}
    prompt = "Once upon a time, in a land far away,"
    s = Stream(port, prompt, 48)
    check(s.first.wait(WAIT_S), "the stream before `down` sent no event")
    t0 = time.monotonic()
    p.compose("down", "-v", timeout=bound + 60)
    took = time.monotonic() - t0
    codes = {}
    for svc, w in waits.items():
        out, _ = w.communicate(timeout=30)
        codes[svc] = out.strip()
    texts = {svc: l.communicate(timeout=30)[0] for svc, l in logs.items()}
    end = s.result()
    want = ref.text(prompt, False, 48)
    check(end[0] == "finished" and end[1] == want,
          f"the stream in flight at `down` ended as {end[:3]}, not {want!r}")
    bad = {svc: c for svc, c in codes.items() if c != "0"}
    check(not bad, f"{p.name}: exit codes at `down`: {bad} (logs: "
                   f"{ {svc: texts[svc][-1500:] for svc in bad} })")
    check(took < bound, f"{p.name}: `down` took {took:.1f} s, past the drain bound {bound:.0f} s")
    drains = []
    for svc in services:
        if svc.startswith(("decode", "prefill")):
            line = next((l for l in texts[svc].splitlines() if " drained: " in l), None)
            check(line, f"{svc}: no drain line in its log:\n{texts[svc][-2000:]}")
            check(" 0 reservations open, 0 of " in line, f"{svc}: state left behind: {line}")
            drains.append(line.strip())
        elif svc == "router":
            check("kvmesh router drained" in texts[svc], f"router: no drain line")
    ok(f"{p.name}: `down` with a stream in flight: the stream finished, equal to `kvmesh "
       f"generate`; {len(codes)} containers exited 0 in {took:.1f} s (drain bound {bound:.0f} s)")
    for line in drains:
        ok(f"{p.name}:   {line}")


def certs_args(compose_file):
    """The arguments of the `kvmesh certs` command in the compose file's
    header (continued lines joined), less its `--out`."""
    text = open(compose_file).read()
    m = re.search(r"^#\s+kvmesh certs (.*?[^\\])$", text, re.M | re.S)
    check(m, f"{compose_file}: no `kvmesh certs` command in its header")
    argv = shlex.split(re.sub(r"\\\n#", " ", m.group(1)))
    out = []
    for a in argv:
        if out and out[-1] == "--out":
            out.pop()
        elif not a.startswith("--out="):
            out.append(a)
    return out


def check_etcd_tls(p, mesh_file):
    """The etcd variant runs inside TLS, and its etcd refuses plaintext and
    a client certificate of another CA."""
    mesh_in = "/etc/kvmesh/" + os.path.basename(mesh_file)
    for svc in ["router", "prefill-0", "decode-0", "decode-1"]:
        role = "router" if svc == "router" else svc.split("-")[0]
        argv = [role, "--config", mesh_in] + ([] if svc == "router" else ["--name", svc])
        out = p.docker("exec", p.container(svc), "kvmesh", *argv, "--check-config")
        check(out.returncode == 0, f"{svc}: --check-config in its container: {out.stderr[-2000:]}")
        for want in ["TLS: mutual", "discovery etcd: https://etcd:2379",
                     "TLS with a client certificate"]:
            check(want in out.stdout, f"{svc}: {want!r} not in {out.stdout!r}")
        check("readable by other users" not in out.stderr, f"{svc}: {out.stderr}")
    # Plaintext from inside the network: etcd over http would answer
    # /version with its JSON ({"etcdserver": ...}).
    probe = ("exec 3<>/dev/tcp/etcd/2379 && printf 'GET /version HTTP/1.0\\r\\n\\r\\n' >&3 "
             "&& timeout 5 cat <&3")
    out = p.docker("exec", p.container("router"), "bash", "-c", probe)
    check("etcdserver" not in out.stdout,
          f"etcd answered plaintext HTTP on etcd:2379: {out.stdout[:300]!r}")
    check("Connection refused" not in out.stderr, f"nothing listens on etcd:2379: {out.stderr}")
    plain = out.stdout.strip().splitlines()[:1] or ["nothing"]
    # A node with a certificate of another CA, trusting the mesh's CA for
    # etcd's (so its own side accepts etcd): only etcd's client-certificate
    # check can stop it registering.
    rogue = os.path.join(p.a.project, "deploy/rogue")
    made = subprocess.run([p.a.kvmesh, "certs", "--out", rogue, "--name", "decode-1"],
                          capture_output=True, text=True, timeout=60)
    check(made.returncode == 0, f"kvmesh certs (another CA): {made.stderr}")
    os.chown(os.path.join(rogue, "decode-1-key.pem"), 10001, -1)
    text = open(mesh_file).read()
    check(text.count('"certs/{name}') == 4, f"{mesh_file}: expected 4 certs/{{name}} paths")
    with open(os.path.join(p.a.project, "deploy/mesh-rogue.yaml"), "w") as f:
        f.write(text.replace('"certs/{name}', '"rogue/{name}'))
    # Beside the mesh file the service mounts, so its relative paths
    # (the secret, certs/ca.pem) resolve as in the mesh.
    rogue_in = "/etc/kvmesh/mesh-rogue.yaml"
    mounts = []
    for host, inside in [("deploy/mesh-rogue.yaml", rogue_in),
                         ("deploy/rogue/decode-1.pem", "/etc/kvmesh/rogue/decode-1.pem"),
                         ("deploy/rogue/decode-1-key.pem", "/etc/kvmesh/rogue/decode-1-key.pem")]:
        mounts += ["-v", f"{os.path.join(p.a.project, host)}:{inside}:ro"]
    refused_before = p.logs("etcd").count("failed to verify client certificate")
    t0 = time.monotonic()
    out = p.compose("run", "--rm", "-T", "--no-deps", *mounts, "decode-1", "decode", "--config",
                    rogue_in, "--name", "decode-1", timeout=120, check_rc=False)
    said = (out.stdout + out.stderr)[-1500:]
    check(out.returncode != 0, f"a node with another CA's certificate ran: {said}")
    check("in etcd" in said and "registering" in said,
          f"the node with another CA's certificate failed, but not registering in etcd: {said}")
    # And it was etcd that refused the certificate (the client sees the
    # alert, or only the connection closed: TLS 1.3 checks it after the
    # client's side of the handshake is done).
    refused = "failed to verify client certificate"
    etcd_log = p.logs("etcd")
    check(etcd_log.count(refused) > refused_before,
          f"etcd logged no refused client certificate: {etcd_log[-2000:]}")
    refusal = next((l for l in reversed(said.splitlines()) if "in etcd" in l), "")
    refusal = refusal[refusal.find("registering"):][:160] + " ..."
    etcd_said = next(l for l in reversed(etcd_log.splitlines()) if refused in l)
    etcd_said = etcd_said[etcd_said.find("rejected connection"):][:200]
    ok(f"{p.name}: inside TLS: every node's --check-config in its container says mutual TLS "
       f"and etcd over https with a client certificate; plaintext HTTP to etcd:2379 from the "
       f"router's container got no answer from etcd (it got {plain[0][:80]!r}); a node with "
       f"another CA's certificate could not register in etcd ({time.monotonic() - t0:.1f} s) "
       f"and exited {out.returncode}: {refusal}; etcd: {etcd_said}")


def run_mesh(args, ref, name, files, mesh_file, decodes, profiles=()):
    env = {"KVMESH_HTTP_PORT": "127.0.0.1:", "KVMESH_GRPC_PORT": "127.0.0.1:"}
    p = Project(args, name, files, env, profiles)
    try:
        port = check_up(p, decodes)
        if "docker-compose.etcd.yml" in files:
            check_etcd_tls(p, mesh_file)
        check_golden(p, port, ref)
        check_kill_and_restart(p, port, ref, decodes)
        check_down(p, port, ref, mesh_file)
    except BaseException:
        for s in kvmesh_services(p):
            note(f"{name}: last log lines of {s}:\n{p.logs(s)[-3000:]}")
        raise
    finally:
        p.down()


def two_decode_override(folder):
    """docker-compose.yml has one decode node: an override adds decode-1,
    defined as decode-0 is, and mounts a mesh file that lists it (the
    static mesh's router knows its nodes from the file)."""
    base = yaml.safe_load(open(os.path.join(folder, "docker-compose.yml")))
    mesh = open(os.path.join(folder, "deploy/mesh.yaml")).read()
    head, sep, entries = mesh.partition("\ndecode:\n")
    check(sep and entries.lstrip().startswith("- name: decode-0") and "\n- " not in entries
          and entries.count("- name:") == 1 and not re.search(r"^\S", entries, re.M),
          "deploy/mesh.yaml: decode-0 is not the one entry of a final `decode:` list")
    two = mesh.rstrip("\n") + "\n" + entries.replace("decode-0", "decode-1").rstrip("\n") + "\n"
    with open(os.path.join(folder, "deploy/mesh-two-decode.yaml"), "w") as f:
        f.write(two)
    mount = "./deploy/mesh-two-decode.yaml:/etc/kvmesh/mesh.yaml:ro"
    services = {s: {"volumes": [mount]} for s in base["services"]}
    d1 = copy.deepcopy(base["services"]["decode-0"])
    d1.pop("build", None)
    d1["command"] = [a.replace("decode-0", "decode-1") for a in d1["command"]]
    d1["volumes"] = [mount if v.endswith(":/etc/kvmesh/mesh.yaml:ro") else v for v in d1["volumes"]]
    services["decode-1"] = d1
    path = os.path.join(folder, "two-decode.override.yml")
    with open(path, "w") as f:
        json.dump({"version": base.get("version", "3.9"), "services": services} if "version" in base
                  else {"services": services}, f, indent=1)
    return path


def check_gpu(args, name):
    p = Project(args, name, ["docker-compose.gpu.yml"],
                {"KVMESH_HTTP_PORT": "127.0.0.1:", "KVMESH_GRPC_PORT": "127.0.0.1:"})
    p.compose("config", "-q")
    want = {"decode-0": ["1"], "prefill-0": ["0"], "router": None}
    try:
        p.compose("up", "--no-start", "--no-build")
        for svc, ids in want.items():
            c = p.inspect(p.container(svc))
            reqs = c["HostConfig"].get("DeviceRequests") or []
            if ids is None:
                check(not reqs, f"gpu: {svc} reserves a device: {reqs}")
                continue
            check(len(reqs) == 1 and reqs[0].get("Driver") == "nvidia"
                  and reqs[0].get("DeviceIDs") == ids
                  and reqs[0].get("Capabilities") == [["gpu"]],
                  f"gpu: {svc}'s device requests {reqs}, not nvidia {ids} [gpu]")
            env = c["Config"]["Env"]
            check("KVMESH_CUDA_LIB_DIR=/opt/kvmesh/cuda/lib" in env and "KVMESH_LOG=info" in env,
                  f"gpu: {svc}'s environment {env}")
        ok("docker-compose.gpu.yml: `config` accepts it; the created containers carry the "
           "reservations: decode-0 nvidia device 1 [gpu], prefill-0 nvidia device 0 [gpu], "
           "router none, and KVMESH_CUDA_LIB_DIR in their environment")
        out = p.compose("start", "decode-0", check_rc=False)
        said = [l for l in out.stderr.splitlines() if "Cannot start" in l or "driver" in l]
        note(f"docker-compose.gpu.yml: not served (no GPU here); `start decode-0`: "
             f"{'started' if out.returncode == 0 else ' '.join(said[-1:]) or out.stderr.strip()}")
    finally:
        p.down()


def main():
    if sys.argv[1:2] == ["--certs-args"]:
        # For compose-check.sh: the header's `kvmesh certs` arguments, one a line.
        print("\n".join(certs_args(sys.argv[2])))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--project", required=True, help="folder with the compose files' copies")
    ap.add_argument("--name", required=True, help="prefix of the compose project names")
    ap.add_argument("--kvmesh", required=True, help="the binary for `kvmesh generate`")
    ap.add_argument("--model", required=True, help="the model file baked into the image")
    ap.add_argument("--docker", default="docker")
    ap.add_argument("--compose", default="docker-compose")
    args = ap.parse_args()
    ref = Reference(args.kvmesh, args.model)
    t0 = time.monotonic()
    try:
        check_gpu(args, f"{args.name}gpu")
        override = two_decode_override(args.project)
        run_mesh(args, ref, f"{args.name}static", ["docker-compose.yml", override],
                 os.path.join(args.project, "deploy/mesh.yaml"), ["decode-0", "decode-1"])
        run_mesh(args, ref, f"{args.name}etcd", ["docker-compose.etcd.yml"],
                 os.path.join(args.project, "deploy/mesh-etcd.yaml"), ["decode-0", "decode-1"],
                 profiles=["more"])
    except Failed as e:
        print(f"==> compose-check: FAILED: {e}", flush=True)
        return 1
    ok(f"every container check held ({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
