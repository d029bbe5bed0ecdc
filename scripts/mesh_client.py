"""A client of a running kvmesh router, for the checks that run the mesh
from outside (scripts/compose_check.py): plain and streamed completions,
the router's metrics, and a stream read on its own thread. Standard
library only."""

import http.client
import json
import threading
import time

# Bound on a stream's wait for its end.
WAIT_S = 60.0


class Failed(Exception):
    """A check that did not hold; the message names it."""


def check(cond, what):
    if not cond:
        raise Failed(what)


def request(port, method, path, body=None, timeout=120):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = json.dumps(body) if body is not None else None
        c.request(method, path, data, {"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read().decode()
    finally:
        c.close()


def try_get(port, path):
    try:
        return request(port, "GET", path, timeout=5)
    except OSError:
        return None, ""


def metrics(port):
    """The router's /metrics as {"name{labels}": value}."""
    status, text = request(port, "GET", "/metrics")
    check(status == 200, f"/metrics answered {status}")
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                pass
    return out


def granted(port, node):
    return metrics(port).get(f'kvmesh_node_reservations_granted_total{{node="{node}"}}', 0.0)


def node_up(port, node):
    return metrics(port).get(f'kvmesh_node_up{{node="{node}",role="decode"}}') == 1.0


def body_for(prompt, chat, max_tokens, stream, **extra):
    if chat:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}
    else:
        path, body = "/v1/completions", {"prompt": prompt}
    body.update(max_tokens=max_tokens, temperature=0, stream=stream, **extra)
    return path, body


class Stream(threading.Thread):
    """A streamed completion read on its own thread. `first` is set at the
    first event; `end` is ("finished", text, finish_reason, tokens),
    ("error", code, event) or ("broken", events); `ended_at` is when the
    stream closed (time.monotonic())."""

    def __init__(self, port, prompt, max_tokens, **extra):
        super().__init__(daemon=True)
        self.port, self.prompt, self.max_tokens, self.extra = port, prompt, max_tokens, extra
        self.first = threading.Event()
        self.end = None
        self.ended_at = None
        self.start()

    def run(self):
        events = []
        try:
            path, body = body_for(self.prompt, False, self.max_tokens, True, **self.extra)
            c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
            c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            r = c.getresponse()
            if r.status != 200:
                self.end = ("broken", [f"status {r.status}: {r.read().decode()}"])
                return
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data:"):
                    events.append(line[5:].strip())
                    self.first.set()
        except OSError as e:
            events.append(f"transport error: {e}")
        finally:
            self.ended_at = time.monotonic()
            self.first.set()
        self.end = classify(events)

    def result(self, bound=WAIT_S):
        self.join(bound)
        check(not self.is_alive(), f"stream of {self.prompt!r} still open after {bound:.0f} s")
        return self.end


def classify(events):
    if len(events) >= 2 and events[-1] == "[DONE]":
        try:
            last = json.loads(events[-2])
        except ValueError:
            return ("broken", events)
        if "error" in last:
            return ("error", last["error"].get("code"), events[-2])
        chunks = [json.loads(e).get("choices") or [{}] for e in events[:-1]]
        text = "".join(c[0].get("text") or "" for c in chunks)
        finish = last["choices"][0].get("finish_reason") if last.get("choices") else None
        tokens = (last.get("usage") or {}).get("completion_tokens")
        return ("finished", text, finish, tokens)
    return ("broken", events)


def complete(port, prompt, chat, max_tokens, stream):
    """Text of one greedy request, or Failed naming the answer."""
    path, body = body_for(prompt, chat, max_tokens, stream)
    if not stream:
        status, text = request(port, "POST", path, body)
        if status != 200:
            return None, text
        c = json.loads(text)["choices"][0]
        return (c["message"]["content"] if chat else c["text"]) or "", None
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        return None, f"status {r.status}: {r.read().decode()}"
    text = ""
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return text, None
        v = json.loads(data)
        if "error" in v:
            return None, data
        ch = v["choices"][0] if v.get("choices") else {}
        piece = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
        text += piece or ""
    return None, "stream ended without [DONE]"
