"""Soak: N short requests over keep-alive connections against one `mlx-spec serve`.

Passes when every request got its own answer (200, a response id seen once, the same greedy
text and prompt token count as every other request with its prompt: nothing lost, duplicated
or crossed), the server's finished-request count grew by exactly N, and the server's RSS
(/proc/PID/status) and MLX active memory (/metrics) at the end are within 5% of their level
after the first 100 requests (the first third, for fewer than 300).

    python tests/openai/soak.py --requests 10000 [--clients 4] [--out report.json]

`cargo xtask soak --requests N` runs this; the pytest suite runs a slice (test_soak_slice).
"""

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from conftest import SERVED, Server, parse_prometheus  # noqa: E402

VARIANTS = 24
TOLERANCE = 0.05


def rss_bytes(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def mlx_active(samples):
    """MLX active memory from /metrics (a gauge named like *active_memory*), or None."""
    vals = [v for (n, _), v in samples.items() if "active_memory" in n or "mlx_memory_active" in n]
    return sum(vals) if vals else None


def finished_count(samples):
    """Requests the server finished: mlx_spec:request_success_total over every finished_reason
    (else the end-to-end latency histogram's count)."""
    for name in ("mlx_spec:request_success_total", "mlx_spec:e2e_request_latency_seconds_count"):
        vals = [v for (n, _), v in samples.items() if n == name]
        if vals:
            return sum(vals)
    return None


def request_body(i):
    v = i % VARIANTS
    if v % 3 == 0:
        return "/v1/chat/completions", {
            "model": SERVED,
            "messages": [{"role": "user", "content": f"Say the number {v}."}],
            "max_tokens": 2,
            "temperature": 0,
        }
    return "/v1/completions", {"model": SERVED, "prompt": f"Item {v}: the", "max_tokens": 2, "temperature": 0}


def run(n, clients=4, server_args=(), log=print):
    server = Server(["--served-model-name", SERVED, *server_args])
    try:
        return _run(server, n, clients, log)
    finally:
        server.stop()


def _run(server, n, clients, log):
    mark = min(100, max(n // 3, 1))
    lock = threading.Lock()
    state = {"next": 0, "done": 0, "errors": [], "ids": {}, "answers": {}, "mark": None}

    def metrics():
        return parse_prometheus(httpx.get(f"{server.url}/metrics", timeout=30).text)

    before = finished_count(metrics())

    def worker():
        with httpx.Client(base_url=server.url, timeout=120) as h:  # one keep-alive connection
            while True:
                with lock:
                    i = state["next"]
                    if i >= n:
                        return
                    state["next"] += 1
                path, body = request_body(i)
                try:
                    r = h.post(path, json=body)
                    doc = r.json() if r.status_code == 200 else None
                except (httpx.HTTPError, ValueError) as e:
                    with lock:
                        state["errors"].append(f"request {i}: {e!r}")
                    continue
                with lock:
                    if doc is None:
                        state["errors"].append(f"request {i}: {r.status_code} {r.text[:200]}")
                        continue
                    rid = doc.get("id")
                    if rid in state["ids"]:
                        state["errors"].append(f"request {i}: id {rid} already answered request {state['ids'][rid]}")
                    state["ids"][rid] = i
                    ch = doc["choices"][0]
                    answer = (ch.get("text") if "text" in ch else ch["message"]["content"], doc["usage"]["prompt_tokens"])
                    first = state["answers"].setdefault(i % VARIANTS, answer)
                    if answer != first:
                        state["errors"].append(f"request {i}: answer {answer} != {first} of the same prompt")
                    state["done"] += 1
                    if state["done"] == mark:
                        state["mark_pending"] = True

    # the level after the first `mark` requests is sampled by the main thread as soon as they are done
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    last_log = t0
    while any(t.is_alive() for t in threads):
        time.sleep(0.05)
        if state.get("mark_pending") and state["mark"] is None:
            state["mark"] = {"rss": rss_bytes(server.pid), "mlx_active": mlx_active(metrics()), "done": state["done"]}
        if time.monotonic() - last_log > 30:
            last_log = time.monotonic()
            log(f"soak: {state['done']}/{n} done, rss {rss_bytes(server.pid) / 1e6:.1f} MB")
    seconds = time.monotonic() - t0
    end_samples = metrics()
    end = {"rss": rss_bytes(server.pid), "mlx_active": mlx_active(end_samples)}
    after = finished_count(end_samples)
    report = {
        "requests": n,
        "clients": clients,
        "seconds": round(seconds, 1),
        "requests_per_s": round(n / seconds, 2),
        "answered": state["done"],
        "errors": state["errors"][:20],
        "error_count": len(state["errors"]),
        "mark": state["mark"],
        "end": end,
        "server_finished": None if after is None or before is None else after - before,
    }
    problems = []
    if state["done"] != n or state["errors"]:
        problems.append(f"{n - state['done']} requests without their answer, {len(state['errors'])} errors")
    if report["server_finished"] is None:
        problems.append("no mlx_spec:request_success_total metric to count finished requests")
    elif report["server_finished"] != n:
        problems.append(f"the server finished {report['server_finished']} requests, {n} were sent")
    m = state["mark"]
    if m is None:
        problems.append("no level sampled after the first requests")
    else:
        for key in ("rss", "mlx_active"):
            if m[key] is None or end[key] is None:
                problems.append(f"no {key} level")
            elif end[key] > m[key] * (1 + TOLERANCE):
                problems.append(f"{key} grew from {m[key]} to {end[key]} (> {TOLERANCE:.0%})")
    report["problems"] = problems
    report["ok"] = not problems
    return report


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--out", type=Path)
    ap.add_argument("server_args", nargs="*", help="extra `mlx-spec serve` flags (after --)")
    a = ap.parse_args()
    report = run(a.requests, a.clients, a.server_args, log=lambda s: print(s, file=sys.stderr, flush=True))
    text = json.dumps(report, indent=1)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
