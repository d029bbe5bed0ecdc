#!/usr/bin/env python3
"""What the OpenAI surface's features cost, side by side on a running kvmesh
mesh (`kvmesh serve`): each feature against the plain request it extends,
in the same run, one round of each in turn so a slow spell of a shared host
falls on both.

Usage: bench_costs.py --url http://127.0.0.1:8080 [--rounds 8]
                      [--max-tokens 64] [--n 4] [--prompt-words 400]
                      [--only logprobs,json_schema,n] [--json out.json]

Pairs (streamed chat completions, one request at a time):
  logprobs     plain               vs  logprobs=true, top_logprobs=20
  json_schema  plain               vs  response_format json_schema (strict)
  n            n separate requests vs  one request with n samples
               (completions, a fresh ~prompt-words prompt each round, the
               separate requests sent concurrently with seeds s..s+n-1:
               the same samples)

For each side: TTFT (request sent to the first token) and ITL (the gaps
between streamed tokens) at p50 and p99 over every request and gap of the
run, and the ratio feature/baseline. For the n pair also the wall time
until every sample is done and, from the nodes' counters on the router's
/metrics, the prompt tokens prefill computed (given to its prefills minus
found in its prefix cache) and the KV bytes decode received. Standard library only; no
server is started.
"""

import argparse
import concurrent.futures
import http.client
import json
import random
import statistics
import time
import urllib.parse

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 8},
        "summary": {"type": "string"},
    },
    "required": ["title", "year", "tags", "summary"],
    "additionalProperties": False,
}

CHAT = [{"role": "user", "content": "Describe a film you like: its title, year, a few tags and a summary."}]

WORDS = ("river stone lantern orchard copper meadow harbor thistle quarry violet "
         "ember saddle glacier pepper tundra falcon marble willow cobalt acorn").split()


def sse_events(resp):
    """The JSON events of a server-sent-events response, up to `[DONE]`."""
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


class Server:
    def __init__(self, url):
        u = urllib.parse.urlparse(url)
        self.host, self.port = u.hostname, u.port or 80

    def conn(self):
        return http.client.HTTPConnection(self.host, self.port, timeout=600)

    def stream(self, path, body):
        """Sends a streamed request; returns (ttft_s, token arrival times
        relative to the send, usage or None)."""
        c = self.conn()
        start = time.perf_counter()
        c.request("POST", path, json.dumps(dict(body, stream=True, stream_options={"include_usage": True})),
                  {"content-type": "application/json"})
        resp = c.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{path}: HTTP {resp.status}: {resp.read()[:300]!r}")
        times, usage = {}, None
        for ev in sse_events(resp):
            now = time.perf_counter() - start
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices", []):
                delta = ch.get("delta") or {}
                text = delta.get("content") if "delta" in ch else ch.get("text")
                lp = ch.get("logprobs") or {}
                # A chunk carries one token, or with logprobs one entry per
                # token: count tokens where the server says how many.
                n_tok = len(lp.get("content") or lp.get("tokens") or []) or (1 if text else 0)
                times.setdefault(ch.get("index", 0), []).extend([now] * n_tok)
        c.close()
        return times, usage

    def metrics(self):
        c = self.conn()
        c.request("GET", "/metrics")
        text = c.getresponse().read().decode()
        c.close()
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

    def settled(self, wait_s=3.0):
        """The metrics once the nodes' load reports have caught up (two
        equal readings in a row)."""
        last = self.metrics()
        deadline = time.time() + wait_s
        while time.time() < deadline:
            time.sleep(0.5)
            now = self.metrics()
            if now == last:
                return now
            last = now
        return last


def node_sum(m, prefix):
    return sum(v for k, v in m.items() if k.startswith(prefix))


class Side:
    """One side of a pair: TTFTs and ITL gaps over the run."""

    def __init__(self):
        self.ttft, self.itl, self.extra = [], [], {}

    def add(self, times):
        for ts in times.values():
            if ts:
                self.ttft.append(ts[0])
                self.itl.extend(b - a for a, b in zip(ts, ts[1:]))

    def add_extra(self, name, value):
        self.extra.setdefault(name, []).append(value)

    def summary(self):
        def pct(xs, p):
            if not xs:
                return float("nan")
            xs = sorted(xs)
            return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]
        s = {
            "ttft_p50_ms": 1e3 * pct(self.ttft, 50), "ttft_p99_ms": 1e3 * pct(self.ttft, 99),
            "itl_p50_ms": 1e3 * pct(self.itl, 50), "itl_p99_ms": 1e3 * pct(self.itl, 99),
            "gaps": len(self.itl),
        }
        for k, v in self.extra.items():
            s[k] = statistics.median(v)
        return s


def pair_logprobs(srv, a, base, feat, rnd):
    body = {"messages": CHAT, "max_tokens": a.max_tokens, "temperature": 0.8, "seed": rnd, "ignore_eos": True}
    for side, b in ((base, body), (feat, dict(body, logprobs=True, top_logprobs=20))):
        times, _ = srv.stream("/v1/chat/completions", b)
        side.add(times)


def pair_json_schema(srv, a, base, feat, rnd):
    body = {"messages": CHAT, "max_tokens": a.max_tokens, "temperature": 0.8, "seed": rnd}
    rf = {"type": "json_schema", "json_schema": {"name": "film", "schema": SCHEMA, "strict": True}}
    for side, b in ((base, body), (feat, dict(body, response_format=rf))):
        times, usage = srv.stream("/v1/chat/completions", b)
        side.add(times)
        if usage:
            side.add_extra("completion_tokens", usage["completion_tokens"])


def pair_n(srv, a, base, feat, rnd, rng):
    def run(side, fn):
        # Never seen by this server: a nonce first, then random words.
        prompt = f"{time.time_ns()} " + " ".join(rng.choice(WORDS) for _ in range(a.prompt_words))
        before = srv.settled()
        start = time.perf_counter()
        prefilled = fn(prompt)
        side.add_extra("wall_s", time.perf_counter() - start)
        after = srv.settled()
        diff = lambda p: node_sum(after, p) - node_sum(before, p)
        hits = diff('kvmesh_node_prefix_cache_hit_tokens_total{node="prefill')
        side.add_extra("prefill_computed_tokens", prefilled - hits)
        side.add_extra("decode_kv_bytes_received", diff('kvmesh_node_kv_bytes_received_total{node="decode'))

    body = {"max_tokens": a.max_tokens, "temperature": 0.8, "ignore_eos": True}
    seed = 1000 * rnd

    # Each returns the prompt tokens its prefills were given (each sample
    # is one prefill): computed = those - prefill's cache hits.
    def separate(prompt):
        given = 0
        with concurrent.futures.ThreadPoolExecutor(max_workers=a.n) as pool:
            for times, usage in pool.map(
                    lambda i: srv.stream("/v1/completions", dict(body, prompt=prompt, seed=seed + i)), range(a.n)):
                base.add(times)
                given += usage["prompt_tokens"]
        return given

    def together(prompt):
        times, usage = srv.stream("/v1/completions", dict(body, prompt=prompt, seed=seed, n=a.n))
        feat.add(times)
        return usage["prompt_tokens"] * a.n

    order = [(base, separate), (feat, together)]
    for side, fn in order if rnd % 2 == 0 else order[::-1]:
        run(side, fn)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt-words", type=int, default=400)
    ap.add_argument("--only", default="logprobs,json_schema,n")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json")
    a = ap.parse_args()
    srv = Server(a.url)
    rng = random.Random(a.seed)
    pairs = {
        "logprobs": ("plain", "top_logprobs=20", pair_logprobs),
        "json_schema": ("plain", "json_schema", pair_json_schema),
        "n": (f"{a.n} separate", f"n={a.n}", None),
    }
    chosen = [p for p in a.only.split(",") if p]
    sides = {p: (Side(), Side()) for p in chosen}
    # Warm-up: the first constrained request builds the token trie.
    srv.stream("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4,
                                        "response_format": {"type": "json_object"}})
    for rnd in range(a.rounds):
        for p in chosen:
            base, feat = sides[p]
            if p == "n":
                pair_n(srv, a, base, feat, rnd, rng)
            else:
                pairs[p][2](srv, a, base, feat, rnd)
        print(f"round {rnd + 1}/{a.rounds} done", flush=True)
    report = {}
    print(f"\n{a.rounds} rounds, max_tokens {a.max_tokens}; p50/p99 over every request and token gap")
    for p in chosen:
        bname, fname, _ = pairs[p]
        b, f = sides[p][0].summary(), sides[p][1].summary()
        report[p] = {bname: b, fname: f}
        print(f"\n{p}:\n{'':28}{bname:>16}{fname:>16}{'ratio':>10}")
        for k in b:
            x, y = b[k], f.get(k, float("nan"))
            ratio = f"{y / x:.3f}" if x else "-"
            print(f"{k:28}{x:>16.3f}{y:>16.3f}{ratio:>10}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"args": vars(a), "report": report}, fh, indent=1)


if __name__ == "__main__":
    main()
