"""Fixtures for the `mlx-spec serve` tests: servers started as real processes, clients, schemas.

Environment (set by `cargo xtask serve-test`; the defaults work from the repository root):
- MLX_SPEC_BIN: the mlx-spec binary (default: target/debug/mlx-spec).
- MLX_SPEC_MODEL_DIR: the default model's directory (SmolLM2-135M-Instruct in the mlx-spec
  cache), used where a test needs the path (as a draft model, for `generate`).
- MLX_SPEC_TINY_TARGET, MLX_SPEC_TINY_DSPARK: the tiny Qwen3 target (vocab 256, a byte-level
  tokenizer, a ChatML template) and its DeepSpec DSpark drafter that xtask writes into
  target/serve-fixtures (`test_support::dspark::write_tiny_pair`), for the DSpark tests.
"""

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from jsonschema import Draft202012Validator

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("MLX_SPEC_BIN", ROOT / "target" / "debug" / "mlx-spec"))
MODEL_DIR = Path(
    os.environ.get("MLX_SPEC_MODEL_DIR", Path.home() / ".cache" / "mlx-spec" / "models" / "smollm2-135m-instruct")
)
FIXTURES = ROOT / "target" / "serve-fixtures"
TINY_TARGET = Path(os.environ.get("MLX_SPEC_TINY_TARGET", FIXTURES / "target"))
TINY_DSPARK = Path(os.environ.get("MLX_SPEC_TINY_DSPARK", FIXTURES / "dspark"))
SERVED = "smollm2-test"
LISTENING = re.compile(r"mlx-spec serve: listening on (http://\S+)")
START_TIMEOUT_S = float(os.environ.get("MLX_SPEC_SERVE_START_TIMEOUT", "300"))

_SCHEMAS = json.loads((Path(__file__).with_name("openai-schemas.json")).read_text())
_VALIDATORS = {}


def validate(doc, name):
    """Asserts `doc` validates against the OpenAI component schema `name`."""
    v = _VALIDATORS.get(name)
    if v is None:
        v = Draft202012Validator({"$ref": f"#/$defs/{name}", "$defs": _SCHEMAS["$defs"]})
        _VALIDATORS[name] = v
    errors = sorted(v.iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, f"{name}: " + "; ".join(
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors[:5]
    ) + f"\n{json.dumps(doc)[:2000]}"


class Server:
    """One `mlx-spec serve --port 0 ARGS` process; `url` once it listens and /health is 200."""

    def __init__(self, args, wait_healthy=True):
        self.args = [str(BIN), "serve", "--port", "0", *map(str, args)]
        self.log = []
        self._listening = threading.Event()
        self.url = None
        self.proc = subprocess.Popen(
            self.args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._listening.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{' '.join(self.args)}: no listening line\n{self.log_tail()}")
        if wait_healthy:
            self.wait_health(200, deadline - time.monotonic())

    def _read_stderr(self):
        for line in self.proc.stderr:
            self.log.append(line.rstrip("\n"))
            m = LISTENING.search(line)
            if m and self.url is None:
                self.url = m.group(1).rstrip("/")
                self._listening.set()

    def log_tail(self, n=40):
        return "\n".join(self.log[-n:])

    @property
    def pid(self):
        return self.proc.pid

    def health(self):
        try:
            return httpx.get(f"{self.url}/health", timeout=10).status_code
        except httpx.HTTPError:
            return None

    def wait_health(self, code, timeout_s):
        deadline = time.monotonic() + max(timeout_s, 1)
        last = None
        while time.monotonic() < deadline:
            last = self.health()
            if last == code:
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"/health stayed {last}, expected {code}\n{self.log_tail()}")

    def client(self, **kw):
        """An openai client of this server (`max_retries=0`); the default one is shared."""
        if not kw:
            if getattr(self, "_client", None) is None:
                self._client = self.client(api_key="unused")
            return self._client
        kw.setdefault("api_key", "unused")
        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 300)
        return openai.OpenAI(base_url=f"{self.url}/v1", **kw)

    def http(self, **kw):
        kw.setdefault("timeout", 300)
        return httpx.Client(base_url=self.url, **kw)

    def metrics(self):
        """The /metrics samples: {(name, frozenset(labels.items())): value}."""
        r = httpx.get(f"{self.url}/metrics", timeout=30)
        assert r.status_code == 200, r.text
        return parse_prometheus(r.text)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text):
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = frozenset(_LABEL.findall(m.group(2) or ""))
        try:
            samples[(m.group(1), labels)] = float(m.group(3))
        except ValueError:
            pass
    return samples


def metric(samples, name, **labels):
    """Sum of the samples named `name` (exactly) whose labels include `labels`."""
    want = set(labels.items())
    found = [v for (n, ls), v in samples.items() if n == name and want <= set(ls)]
    assert found, f"no metric {name}{labels or ''}; have: {sorted({n for n, _ in samples})}"
    return sum(found)


@pytest.fixture(scope="module")
def server():
    """The main server: default drafter (suffix), test faults on, a served name."""
    s = Server(["--served-model-name", SERVED, "--test-faults"])
    yield s
    s.stop()
    print(f"\n--- server log tail ({' '.join(s.args)}) ---\n{s.log_tail(15)}", file=sys.stderr)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def generate_text(prompt, max_tokens, *extra):
    """`mlx-spec generate --draft-kind none --temp 0` stdout (the text), its final newline dropped.
    Decoded as UTF-8 without newline translation (a generated `\\r` stays one)."""
    cmd = [str(BIN), "generate", "--draft-kind", "none", "--temp", "0", "--max-tokens", str(max_tokens)]
    out = subprocess.run([*cmd, "--prompt", prompt, *extra], capture_output=True, timeout=600, check=False)
    stderr = out.stderr.decode("utf-8", "replace")
    assert out.returncode == 0, stderr
    stdout = out.stdout.decode("utf-8")
    assert stdout.endswith("\n"), stdout
    return stdout[:-1]
