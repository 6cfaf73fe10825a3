#!/usr/bin/env python3
"""`cargo xtask bench serve`: `mlx-spec serve` vs `mlx_lm.server` through HTTP.

Arms (all on the same model directory, the same chat prompts, greedy, the same max_tokens):
- `mlx-spec plain`: per-request `num_draft_tokens: 0`;
- `mlx-spec spec`: the server's default drafter (suffix, cost-aware length);
- `mlx_lm plain`: `mlx_lm.server --model DIR` through xtask/scripts/mlx_lm_server_f32.py, which
  makes it compute in float32 like ours (in the stored float16 its CPU path is ~100x slower);
  mlx_lm has no model-free drafter, its `--draft-model` path turns batching off, and this
  target has no smaller family member.

For each concurrency (1, 2, 4 and 8 clients by default) every client sends `--requests` streaming
chat requests one after the other; each request's prompt starts with a unique tag so that no
prompt-cache entry of an earlier request can serve it (both servers cache prefixes). Arms are
interleaved: round r runs every arm once, in reverse order on odd rounds. Reported per arm and
concurrency: median time to first token (TTFT), median inter-token latency (ITL: a request's
(t_last - t_first) / (tokens - 1)), aggregate completion tokens/s over the arm's wall time.
Also `mlx-spec generate` plain and speculative on the same prompts (one client, no HTTP), to
compare speculation's speedup through HTTP with generate's.

Writes serve-bench.json and serve-bench.md into --out.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
WARMUP_TIMEOUT_S = 120


def prompts():
    rows = [json.loads(line) for line in (ROOT / "fixtures/prompts/spec-equality.jsonl").read_text().splitlines() if line]
    grounded = [r["prompt"] for r in rows if r["kind"] == "grounded"]
    free = [r["prompt"] for r in rows if r["kind"] == "free"]
    # alternate the kinds: half the requests are input-grounded (where drafting pays), half free
    out = []
    for g, f in zip(grounded, free):
        out += [g, f]
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    def __init__(self, argv, env=None, listening=None):
        self.log = []
        self.url = None
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
        )
        self._found = threading.Event()
        self._listening = listening

        def read():
            for line in self.proc.stderr:
                self.log.append(line.rstrip())
                if listening and listening in line and self.url is None:
                    self.url = line.split(listening, 1)[1].strip().rstrip("/")
                    self._found.set()

        threading.Thread(target=read, daemon=True).start()

    def wait_ready(self, url=None, path="/health", timeout=300):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited:\n" + "\n".join(self.log[-30:]))
            if self.url is None and url:
                self.url = url
            if self.url:
                try:
                    if httpx.get(self.url + path, timeout=5).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        raise RuntimeError("server not ready:\n" + "\n".join(self.log[-30:]))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def one_request(url, model, prompt, max_tokens, extra, timeout=600):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    t0 = time.perf_counter()
    first = last = None
    pieces = 0
    usage = None
    with httpx.Client(timeout=timeout) as h, h.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            c = json.loads(data)
            if c.get("usage"):
                usage = c["usage"]
            for ch in c.get("choices") or []:
                if (ch.get("delta") or {}).get("content"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    pieces += 1
    tokens = usage["completion_tokens"] if usage else pieces
    ttft = (first - t0) if first else float("nan")
    itl = (last - first) / (tokens - 1) if first and tokens > 1 else float("nan")
    return {"ttft": ttft, "itl": itl, "tokens": tokens, "seconds": time.perf_counter() - t0}


def run_arm(arm, clients, n, max_tokens, pool, tag):
    results, errors = [], []
    lock = threading.Lock()

    def client(c):
        for i in range(n):
            p = pool[(c * n + i) % len(pool)]
            prompt = f"[{tag} c{c} r{i}] {p}"
            try:
                r = one_request(arm["url"], arm["model"], prompt, max_tokens, arm["extra"])
            except Exception as e:  # noqa: BLE001 - reported, the arm goes on
                with lock:
                    errors.append(repr(e))
                continue
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"results": results, "errors": errors, "wall": wall}


def generate_speedup(bin_path, model, pool, max_tokens):
    """tokens/s of `mlx-spec generate` plain and with its default drafter, summed over prompts."""

    def stats(extra, prompt):
        out = subprocess.run(
            [bin_path, "generate", "--model", model, "--stats-json", "--temp", "0", "--max-tokens", str(max_tokens),
             "--prompt", prompt, *extra],
            capture_output=True, text=True, check=True,
        )
        line = [ln for ln in out.stderr.splitlines() if ln.strip().startswith("{")][-1]
        v = json.loads(line)
        return v.get("emitted", v.get("generation_tokens")), v.get("tokens_per_s", v.get("generation_tps"))

    plain_t = spec_t = 0.0
    for p in pool:
        n, tps = stats(["--draft-kind", "none"], p)
        plain_t += n / tps if tps else 0
        n2, tps2 = stats([], p)
        spec_t += n2 / tps2 if tps2 else 0
    return plain_t / spec_t if spec_t else float("nan")


def med(xs):
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--no-mlx-lm", action="store_true")
    ap.add_argument("--no-generate", action="store_true")
    a = ap.parse_args()
    pool = prompts()

    servers = []
    ours = Proc(
        [a.bin, "serve", "--port", "0", "--model", a.model, "--served-model-name", "bench"],
        listening="mlx-spec serve: listening on ",
    ).wait_ready(path="/health")
    servers.append(ours)
    arms = [
        {"name": "mlx-spec plain", "url": ours.url, "model": "bench", "extra": {"num_draft_tokens": 0}},
        {"name": "mlx-spec spec", "url": ours.url, "model": "bench", "extra": {}},
    ]
    if not a.no_mlx_lm:
        port = free_port()
        env = dict(os.environ)
        if os.environ.get("MLX_LM_LD_PRELOAD"):
            env["LD_PRELOAD"] = os.environ["MLX_LM_LD_PRELOAD"]
        base = Proc(
            [sys.executable, str(ROOT / "xtask/scripts/mlx_lm_server_f32.py"), "--model", a.model, "--port", str(port), "--host", "127.0.0.1"],
            env=env,
        ).wait_ready(url=f"http://127.0.0.1:{port}", path="/health")
        servers.append(base)
        arms.append({"name": "mlx_lm plain", "url": base.url, "model": a.model, "extra": {}})
    try:
        for arm in list(arms):  # warm-up: not counted; an arm that cannot answer is dropped
            try:
                one_request(arm["url"], arm["model"], "Hello", 8, arm["extra"], timeout=WARMUP_TIMEOUT_S)
            except (httpx.HTTPError, RuntimeError) as e:
                print(f"{arm['name']}: no answer to the warm-up request ({e!r}); arm dropped", file=sys.stderr)
                arms.remove(arm)
        raw = {(arm["name"], c): [] for arm in arms for c in a.clients}
        for r in range(a.rounds):
            order = arms if r % 2 == 0 else list(reversed(arms))
            for c in a.clients:
                for arm in order:
                    res = run_arm(arm, c, a.requests, a.max_tokens, pool, f"r{r} {arm['name']}")
                    raw[(arm["name"], c)].append(res)
                    print(f"round {r} {arm['name']} x{c}: {len(res['results'])} ok, {len(res['errors'])} errors, "
                          f"{res['wall']:.1f}s", file=sys.stderr, flush=True)
        batch_metrics = {}
        for line in httpx.get(ours.url + "/metrics", timeout=10).text.splitlines():
            for name in ("mlx_spec:batch_rows_sum", "mlx_spec:batch_rows_count"):
                if line.startswith(name + " "):
                    batch_metrics[name] = float(line.split()[1])
    finally:
        for s in servers:
            s.stop()

    rows = []
    for arm in arms:
        for c in a.clients:
            runs = raw[(arm["name"], c)]
            rs = [x for run in runs for x in run["results"]]
            tokens = sum(x["tokens"] for x in rs)
            wall = sum(run["wall"] for run in runs)
            rows.append({
                "arm": arm["name"], "clients": c, "requests": len(rs),
                "errors": sum(len(run["errors"]) for run in runs),
                "ttft_ms": round(1e3 * med([x["ttft"] for x in rs]), 1),
                "itl_ms": round(1e3 * med([x["itl"] for x in rs]), 2),
                "tok_s": round(tokens / wall, 2) if wall else None,
                "completion_tokens": tokens,
            })
    by = {(r["arm"], r["clients"]): r for r in rows}
    ratios = {}
    for c in a.clients:
        p, s = by[("mlx-spec plain", c)], by[("mlx-spec spec", c)]
        ratios[f"spec/plain x{c}"] = round(s["tok_s"] / p["tok_s"], 3) if p["tok_s"] else None
        # Aggregate scaling: the rate at c clients over the same arm's single-client rate.
        for arm in arms:
            one, many = by.get((arm["name"], 1)), by[(arm["name"], c)]
            if c != 1 and one and one["tok_s"] and many["tok_s"]:
                ratios[f"{arm['name']} x{c}/x1"] = round(many["tok_s"] / one["tok_s"], 3)
        if ("mlx_lm plain", c) in by and by[("mlx_lm plain", c)]["tok_s"]:
            b = by[("mlx_lm plain", c)]["tok_s"]
            ratios[f"ours plain/mlx_lm x{c}"] = round(p["tok_s"] / b, 3)
            ratios[f"ours spec/mlx_lm x{c}"] = round(s["tok_s"] / b, 3)
    if not a.no_generate:
        ratios["generate spec/plain"] = round(generate_speedup(a.bin, a.model, pool[: 2 * a.requests], a.max_tokens), 3)
    if batch_metrics.get("mlx_spec:batch_rows_count"):
        ratios["mlx-spec rows per forward (mean, all arms)"] = round(
            batch_metrics["mlx_spec:batch_rows_sum"] / batch_metrics["mlx_spec:batch_rows_count"], 2)
    report = {
        "model": a.model, "max_tokens": a.max_tokens, "requests_per_client": a.requests, "rounds": a.rounds,
        "clients": a.clients, "prompts": "fixtures/prompts/spec-equality.jsonl (grounded and free alternating)",
        "rows": rows, "ratios": ratios,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "serve-bench.json").write_text(json.dumps(report, indent=1) + "\n")
    md = [
        "# `cargo xtask bench serve`",
        "",
        f"Model `{a.model}`, {a.max_tokens} tokens per request, greedy, {a.requests} requests per client, "
        f"{a.rounds} interleaved rounds; prompts from fixtures/prompts/spec-equality.jsonl.",
        "",
        "| arm | clients | requests | TTFT ms (median) | ITL ms (median) | tok/s (aggregate) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        md.append(f"| {r['arm']} | {r['clients']} | {r['requests']} | {r['ttft_ms']} | {r['itl_ms']} | {r['tok_s']} |")
    md += ["", "| ratio | value |", "|---|---:|"] + [f"| {k} | {v} |" for k, v in ratios.items()]
    (a.out / "serve-bench.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
