#!/usr/bin/env python3
"""n samples in one request against the same samples as separate requests,
side by side on a running kvmesh mesh (`kvmesh serve`), one round each in
turn so a slow spell of a shared host falls on both.

Usage: bench_choices.py --url http://127.0.0.1:8080 [--n 4] [--rounds 5]
                        [--prompt-words 400] [--max-tokens 32]

Each round sends a fresh prompt (never seen, so nothing is cached before
it) as (a) one request with n samples and (b) n separate concurrent
requests with seeds s .. s+n-1 (the same samples: kvmesh's sample i of a
request seeded s is what a request seeded s+i gives). It reports, per
mode, the median wall time until every sample is done and, from the
nodes' load reports on the router's /metrics, the prompt tokens prefill
looked up and found in its prefix cache and the KV bytes decode received.
Standard library only; no server is started.
"""

import argparse
import concurrent.futures
import json
import random
import statistics
import time
import urllib.request


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.load(resp)


def metrics(url):
    with urllib.request.urlopen(url + "/metrics", timeout=60) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        try:
            out[name] = float(value)
        except ValueError:
            pass
    return out


def node_sum(m, prefix):
    return sum(v for k, v in m.items() if k.startswith(prefix))


def settled(url, wait_s=3.0):
    """The metrics once the nodes' load reports have caught up (two equal
    readings in a row)."""
    last = metrics(url)
    deadline = time.time() + wait_s
    while time.time() < deadline:
        time.sleep(0.5)
        now = metrics(url)
        if now == last:
            return now
        last = now
    return last


WORDS = ("river stone lantern orchard copper meadow harbor thistle quarry violet "
         "ember saddle glacier pepper tundra falcon marble willow cobalt acorn").split()


def fresh_prompt(rng, words):
    return " ".join(rng.choice(WORDS) for _ in range(words))


def one_round(url, prompt, n, max_tokens, seed, mode):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "ignore_eos": True}
    before = settled(url)
    start = time.perf_counter()
    if mode == "n":
        r = post(url + "/v1/completions", dict(body, n=n, seed=seed))
        tokens = r["usage"]["completion_tokens"]
    else:
        with concurrent.futures.ThreadPoolExecutor(max_workers=n) as pool:
            rs = list(pool.map(lambda i: post(url + "/v1/completions", dict(body, seed=seed + i)), range(n)))
        tokens = sum(r["usage"]["completion_tokens"] for r in rs)
    wall = time.perf_counter() - start
    after = settled(url)
    diff = lambda p: node_sum(after, p) - node_sum(before, p)
    return {
        "wall_s": wall,
        "completion_tokens": tokens,
        "prefill_lookup_tokens": diff('kvmesh_node_prefix_cache_lookup_tokens_total{node="prefill'),
        "prefill_hit_tokens": diff('kvmesh_node_prefix_cache_hit_tokens_total{node="prefill'),
        "decode_kv_bytes_received": diff('kvmesh_node_kv_bytes_received_total{node="decode'),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-words", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    runs = {"n": [], "separate": []}
    for k in range(a.rounds):
        order = ["n", "separate"] if k % 2 == 0 else ["separate", "n"]
        for mode in order:
            runs[mode].append(one_round(a.url, fresh_prompt(rng, a.prompt_words), a.n, a.max_tokens, 1000 * k, mode))
    med = {m: {f: statistics.median(r[f] for r in rs) for f in rs[0]} for m, rs in runs.items()}
    print(f"n={a.n} in one request vs {a.n} separate concurrent requests; {a.rounds} rounds, "
          f"~{a.prompt_words}-word fresh prompts, {a.max_tokens} tokens each (medians)")
    print(f"{'':28}{'n':>14}{'separate':>14}{'n/separate':>12}")
    for f in ["wall_s", "completion_tokens", "prefill_lookup_tokens", "prefill_hit_tokens", "decode_kv_bytes_received"]:
        x, y = med["n"][f], med["separate"][f]
        ratio = f"{x / y:.3f}" if y else "-"
        print(f"{f:28}{x:>14.3f}{y:>14.3f}{ratio:>12}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "runs": runs, "medians": med}, f, indent=1)


if __name__ == "__main__":
    main()
