"""`mlx-spec serve` through real HTTP: the official `openai` client and raw HTTP (httpx).

What issue 18's "How it is checked" asks, on the default model (SmolLM2-135M-Instruct):
wire format and OpenAI schemas (every response and every stream chunk validated against
openai-schemas.json), errors, lossless speculation (every drafter kind, streaming and not,
equal to `mlx-spec generate`; the DeepSpec DSpark drafter on the tiny target + drafter pair
that xtask writes, as no real DSpark checkpoint with a tokenizer is at hand), seeded
sampling, the prompt cache, concurrency, cancellation, faults and overload, and a bounded
soak slice. Run by `cargo xtask serve-test`.
"""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from conftest import MODEL_DIR, SERVED, TINY_DSPARK, TINY_TARGET, Server, generate_text, metric, validate

GROUNDED = (
    "Repeat this list exactly, one item per line, then stop: apple, banana, cherry, date, "
    "elderberry, fig, grape, honeydew."
)
FREE = "Write a haiku about the sea."
TOKENS = 32

# The extension fields, as `extra_body` of the openai client.
PLAIN = {"num_draft_tokens": 0}


def drafting(kind, k=4):
    return {"num_draft_tokens": k, "draft_kind": kind}


# ---------------------------------------------------------------------------------------------
# helpers


def chat_raw(server, prompt, max_tokens=TOKENS, messages=None, **body):
    """A non-streaming chat completion through the openai client: (raw JSON, parsed object)."""
    client = server.client()
    extra = body.pop("extra_body", None)
    raw = client.chat.completions.with_raw_response.create(
        model=SERVED,
        messages=messages or [{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=body.pop("temperature", 0),
        extra_body=extra,
        **body,
    )
    doc = json.loads(raw.text)
    validate(doc, "CreateChatCompletionResponse")
    return doc, raw.parse()


def chat_text(server, prompt, max_tokens=TOKENS, **body):
    doc, parsed = chat_raw(server, prompt, max_tokens, **body)
    assert doc["choices"][0]["message"]["content"] == parsed.choices[0].message.content
    return doc["choices"][0]["message"]["content"]


def sse(server, path, body, timeout=300):
    """POSTs a streaming request; returns (events, comments, headers): each `data:` event
    parsed (`[DONE]` kept as the string), each `:` comment line."""
    events, comments = [], []
    with httpx.Client(base_url=server.url, timeout=timeout) as h:
        with h.stream("POST", path, json={**body, "stream": True}) as r:
            assert r.status_code == 200, r.read()
            headers = r.headers
            for line in r.iter_lines():
                if not line:
                    continue
                if line.startswith(":"):
                    comments.append(line)
                elif line.startswith("data:"):
                    data = line[5:].strip()
                    events.append(data if data == "[DONE]" else json.loads(data))
                else:
                    # `event:`/`id:` fields are legal SSE, but the openai client ignores them
                    assert line.split(":", 1)[0] in ("event", "id", "retry"), line
    return events, comments, headers


def chat_stream(server, prompt, max_tokens=TOKENS, include_usage=False, messages=None, **body):
    """A streaming chat completion over raw HTTP, every chunk schema-checked and the SSE rules
    of the issue asserted; returns (text, chunks)."""
    req = {
        "model": SERVED,
        "messages": messages or [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": body.pop("temperature", 0),
        **body,
    }
    if include_usage:
        req["stream_options"] = {"include_usage": True}
    events, _, headers = sse(server, "/v1/chat/completions", req)
    assert headers["content-type"].startswith("text/event-stream")
    assert events and events[-1] == "[DONE]", events[-3:]
    chunks = events[:-1]
    assert "[DONE]" not in chunks
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1, f"ids differ across chunks: {ids}"
    text = ""
    finish = None
    for i, c in enumerate(chunks):
        validate(c, "CreateChatCompletionStreamResponse")
        assert c["object"] == "chat.completion.chunk"
        if include_usage:
            assert "usage" in c, "include_usage: every chunk carries `usage`"
        if include_usage and i == len(chunks) - 1:
            assert c["choices"] == [] and c["usage"] is not None, c
            continue
        if include_usage:
            assert c["usage"] is None, c
        assert len(c["choices"]) == 1, c
        delta = c["choices"][0]["delta"]
        if i == 0:
            assert delta.get("role") == "assistant", c
        else:
            assert "role" not in delta, f"role after the first delta: {c}"
        assert finish is None, f"a chunk after finish_reason: {c}"
        finish = c["choices"][0]["finish_reason"]
        text += delta.get("content") or ""
    assert finish in ("stop", "length"), chunks[-2:]
    return text, chunks


def completion_raw(server, prompt, max_tokens=TOKENS, **body):
    client = server.client()
    extra = body.pop("extra_body", None)
    raw = client.completions.with_raw_response.create(
        model=SERVED,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=body.pop("temperature", 0),
        extra_body=extra,
        **body,
    )
    doc = json.loads(raw.text)
    validate(doc, "CreateCompletionResponse")
    assert doc["object"] == "text_completion"
    return doc, raw.parse()


def completion_stream(server, prompt, max_tokens=TOKENS, include_usage=False, **body):
    req = {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **body}
    if include_usage:
        req["stream_options"] = {"include_usage": True}
    events, _, _ = sse(server, "/v1/completions", req)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1
    text = ""
    for i, c in enumerate(chunks):
        if include_usage and i == len(chunks) - 1:
            assert c["choices"] == [] and c["usage"]["completion_tokens"] >= 0, c
            validate(c, "CreateCompletionResponse")
            continue
        # OpenAI's schema types `finish_reason` as non-null (the streamed and the whole
        # response "share the same shape"), yet the API streams null until the last chunk:
        # validate intermediate chunks with the finish reason the last one will carry.
        # Likewise `usage`, which is null on every chunk but the last with include_usage.
        checked = json.loads(json.dumps(c))
        if checked.get("usage", 0) is None:
            del checked["usage"]
        for ch in checked["choices"]:
            if ch.get("finish_reason") is None:
                ch["finish_reason"] = "length"
        validate(checked, "CreateCompletionResponse")
        text += c["choices"][0]["text"]
    return text, chunks


def timings(doc):
    t = doc.get("timings")
    assert isinstance(t, dict), f"no timings: {doc}"
    for key in ("prompt_n", "cache_n", "predicted_n", "predicted_per_second", "draft_n", "draft_n_accepted"):
        assert key in t, f"timings without {key}: {t}"
    return t


def wait_metric(server, name, value, timeout_s, **labels):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = metric(server.metrics(), name, **labels)
        if last == value:
            return time.monotonic()
        time.sleep(0.02)
    raise AssertionError(f"{name} stayed {last} (wanted {value}) for {timeout_s}s")


# ---------------------------------------------------------------------------------------------
# endpoints, wire format, schemas


def test_health_models_and_cors(server):
    r = httpx.get(f"{server.url}/health")
    assert r.status_code == 200, r.text
    r = httpx.get(f"{server.url}/v1/models")
    assert r.status_code == 200
    doc = r.json()
    validate(doc, "ListModelsResponse")
    assert [m["id"] for m in doc["data"]] == [SERVED]
    models = server.client().models.list()
    assert [m.id for m in models.data] == [SERVED]
    # CORS preflight (default: every origin)
    r = httpx.options(
        f"{server.url}/v1/chat/completions",
        headers={
            "Origin": "http://example.com",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type,authorization",
        },
    )
    assert r.status_code in (200, 204), r.text
    assert r.headers.get("access-control-allow-origin") in ("*", "http://example.com"), r.headers
    r = httpx.get(f"{server.url}/v1/models", headers={"Origin": "http://example.com"})
    assert r.headers.get("access-control-allow-origin") in ("*", "http://example.com"), r.headers


def test_chat_non_streaming_shape_usage_timings(server):
    doc, parsed = chat_raw(server, FREE, 12)
    assert doc["object"] == "chat.completion" and doc["model"] == SERVED
    assert doc["id"].startswith("chatcmpl-")
    choice = doc["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    u = doc["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert 0 < u["completion_tokens"] <= 12
    assert "cached_tokens" in u["prompt_tokens_details"]
    t = timings(doc)
    assert t["predicted_n"] == u["completion_tokens"]
    assert t["prompt_n"] + t["cache_n"] == u["prompt_tokens"]
    assert t["cache_n"] == u["prompt_tokens_details"]["cached_tokens"]
    assert "tau" in t or "tau" in doc, "tau per response"
    assert parsed.usage.completion_tokens == u["completion_tokens"]


def test_chat_streaming_with_usage(server):
    text, chunks = chat_stream(server, FREE, 12, include_usage=True)
    usage = chunks[-1]["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert text == chat_text(server, FREE, 12)
    # the official client parses the same stream
    stream = server.client().chat.completions.create(
        model=SERVED,
        messages=[{"role": "user", "content": FREE}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    got, last = "", None
    for c in stream:
        last = c
        if c.choices:
            got += c.choices[0].delta.content or ""
    assert got == text and last.usage.completion_tokens == usage["completion_tokens"]
    # without include_usage there is no usage chunk
    _, chunks = chat_stream(server, FREE, 4)
    assert all(c["choices"] for c in chunks)


def test_completions_streaming_and_not(server):
    doc, parsed = completion_raw(server, "The capital of France is", 8)
    assert doc["id"].startswith("cmpl-")
    text = doc["choices"][0]["text"]
    assert parsed.choices[0].text == text
    streamed, _ = completion_stream(server, "The capital of France is", 8, include_usage=True)
    assert streamed == text


def test_extension_and_unknown_fields_are_accepted(server):
    doc, _ = chat_raw(
        server,
        FREE,
        2,
        top_p=0.9,
        seed=3,
        user="someone",
        store=False,
        metadata={"k": "v"},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "top_k": 20, "min_p": 0.05, "x_unknown": 1},
    )
    assert doc["usage"]["completion_tokens"] > 0


def test_max_completion_tokens_wins(server):
    doc, _ = chat_raw(server, GROUNDED, 20, max_completion_tokens=3)
    assert doc["usage"]["completion_tokens"] == 3 and doc["choices"][0]["finish_reason"] == "length"


# ---------------------------------------------------------------------------------------------
# errors


def test_bad_requests_are_400_bad_request_errors(server):
    client = server.client()
    bad = [
        ({"max_tokens": "many"}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"extra_body": {"num_draft_tokens": -2}}, "num_draft_tokens"),
        ({"extra_body": {"draft_kind": "telepathy"}}, "draft_kind"),
        ({"messages": "hello"}, "messages"),
    ]
    for fields, param in bad:
        kw = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**kw)
        body = e.value.body
        assert e.value.status_code == 400
        err = e.value.response.json()
        validate(err, "ErrorResponse")
        assert err["error"]["type"] == "invalid_request_error", err
        assert param in (err["error"]["param"] or "") or param in err["error"]["message"], (fields, err)
        assert body is not None
    # malformed JSON, wrong content type, not an object
    with server.http() as h:
        for data in (b"{not json", b"[1, 2]", b'{"model": "x", "messages": [{"role": "user"'):
            r = h.post("/v1/chat/completions", content=data, headers={"content-type": "application/json"})
            assert r.status_code == 400, (data, r.status_code, r.text)
            validate(r.json(), "ErrorResponse")
        r = h.post("/v1/completions", json={"model": SERVED, "prompt": 42})
        assert r.status_code == 400, r.text
        validate(r.json(), "ErrorResponse")


def test_unknown_model_is_a_400(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    err = e.value.response.json()
    validate(err, "ErrorResponse")
    assert err["error"]["param"] == "model", err


def test_prompt_longer_than_the_context_is_a_400_and_20_mb_bodies_are_read(server):
    # 8192 positions (SmolLM2): a prompt of ~9000 tokens does not fit
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model=SERVED, prompt="hello " * 9000, max_tokens=2)
    validate(e.value.response.json(), "ErrorResponse")
    # a 20 MB body is read (no 413; long prompts come in big bodies): here most of it is in a
    # field the server ignores, so that the check costs no tokenization
    body = {"model": SERVED, "prompt": "hi", "max_tokens": 1, "x_padding": "x" * (20 * 1024 * 1024)}
    with server.http() as h:
        r = h.post("/v1/completions", json=body)
    assert r.status_code == 200, (r.status_code, r.text[:300])
    validate(r.json(), "CreateCompletionResponse")
    # the server still serves
    assert chat_text(server, FREE, 2)


@pytest.fixture(scope="module")
def keyed_server():
    s = Server(["--served-model-name", SERVED, "--api-key", "sekrit"])
    yield s
    s.stop()


def test_api_key(keyed_server):
    with pytest.raises(openai.AuthenticationError) as e:
        keyed_server.client(api_key="wrong").chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    validate(e.value.response.json(), "ErrorResponse")
    r = httpx.get(f"{keyed_server.url}/v1/models")
    assert r.status_code == 401
    validate(r.json(), "ErrorResponse")
    # /health stays open
    assert httpx.get(f"{keyed_server.url}/health").status_code == 200
    out = keyed_server.client(api_key="sekrit").chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert out.usage.completion_tokens > 0


# ---------------------------------------------------------------------------------------------
# lossless speculation through HTTP

_PLAIN_CACHE = {}


def plain(server, prompt, max_tokens=TOKENS):
    key = (server.url, prompt, max_tokens)
    if key not in _PLAIN_CACHE:
        doc, _ = chat_raw(server, prompt, max_tokens, extra_body=PLAIN)
        assert timings(doc)["draft_n"] == 0, "num_draft_tokens 0 drafts nothing"
        _PLAIN_CACHE[key] = doc["choices"][0]["message"]["content"]
    return _PLAIN_CACHE[key]


@pytest.mark.parametrize("prompt", [GROUNDED, FREE], ids=["grounded", "free"])
def test_plain_equals_generate(server, prompt):
    assert plain(server, prompt) == generate_text(prompt, TOKENS)


def test_completions_equal_generate_without_template(server):
    prompt = "Once upon a time, in a small village by the sea,"
    doc, _ = completion_raw(server, prompt, 16, extra_body=PLAIN)
    assert doc["choices"][0]["text"] == generate_text(prompt, 16, "--ignore-chat-template")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", ["suffix", "ngram"])
@pytest.mark.parametrize("prompt", [GROUNDED, FREE], ids=["grounded", "free"])
def test_greedy_drafting_equals_plain(server, prompt, kind, stream):
    want = plain(server, prompt)
    if stream:
        got, _ = chat_stream(server, prompt, TOKENS, **drafting(kind))
    else:
        doc, _ = chat_raw(server, prompt, TOKENS, extra_body=drafting(kind))
        got = doc["choices"][0]["message"]["content"]
        t = timings(doc)
        if kind == "ngram" and prompt == GROUNDED:
            assert t["draft_n"] > 0 and t["draft_n_accepted"] > 0, f"n-gram drafting did not draft: {t}"
    assert got == want


def test_default_drafter_equals_plain(server):
    # no extension field at all: the server's default drafter
    for prompt in (GROUNDED, FREE):
        assert chat_text(server, prompt, TOKENS) == plain(server, prompt)


@pytest.fixture(scope="module")
def draft_model_server():
    # the target as its own draft model: every kind of drafter the server can hold
    s = Server(["--served-model-name", SERVED, "--draft-model", MODEL_DIR])
    yield s
    s.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_draft_model_equals_plain(draft_model_server, server, stream):
    for prompt in (GROUNDED, FREE):
        want = plain(server, prompt)
        if stream:
            got, _ = chat_stream(draft_model_server, prompt, TOKENS, **drafting("model", 3))
        else:
            doc, _ = chat_raw(draft_model_server, prompt, TOKENS, extra_body=drafting("model", 3))
            got = doc["choices"][0]["message"]["content"]
            t = timings(doc)
            assert t["draft_n"] > 0 and t["draft_n_accepted"] > 0, t
        assert got == want
    if not stream:
        # the drafters that need no weights are there too, and plain decoding
        for body in (PLAIN, drafting("ngram"), drafting("suffix")):
            assert chat_text(draft_model_server, GROUNDED, TOKENS, extra_body=body) == plain(server, GROUNDED)


# The DSpark drafter: the tiny Qwen3 target (vocab 256, one token per byte; its greedy text
# is mostly control bytes and U+FFFD, which is what a byte-level tokenizer decodes a random
# model's output to) and its DSpark drafter, whose Markov head knows the target's bigram, so
# it drafts and has drafts accepted and rejected.
TINY_BLOCK = 7  # test_support::dspark::BLOCK_SIZE, the default k with a DSpark drafter
TINY_TOKENS = 48
TINY_CHAT = ["Tell me about the sea.", "Repeat this list exactly: apple, banana, cherry, date."]
TINY_RAW = ["Once upon a time", "def add(a, b):\n    return a + b\n"]


@pytest.fixture(scope="module")
def dspark_server():
    s = Server(["--served-model-name", SERVED, "--model", TINY_TARGET, "--draft-model", TINY_DSPARK])
    yield s
    s.stop()


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_dspark_drafter_equals_plain_and_generate(dspark_server, endpoint):
    """Greedy output with `num_draft_tokens` 0 equals the DSpark drafter's at the default k,
    k 3 and k = the block size, streaming and not, and equals `mlx-spec generate
    --draft-kind none` on the same prompt; the speculative requests drafted."""
    s = dspark_server
    chat = endpoint == "chat"

    def whole(prompt, extra):
        if chat:
            doc, _ = chat_raw(s, prompt, TINY_TOKENS, extra_body=extra)
            return doc["choices"][0]["message"]["content"], doc
        doc, _ = completion_raw(s, prompt, TINY_TOKENS, extra_body=extra)
        return doc["choices"][0]["text"], doc

    def stream(prompt, extra):
        f = chat_stream if chat else completion_stream
        text, _ = f(s, prompt, TINY_TOKENS, **(extra or {}))
        return text

    for prompt in TINY_CHAT if chat else TINY_RAW:
        want, doc = whole(prompt, PLAIN)
        t = timings(doc)
        assert t["draft_n"] == 0 and t["predicted_n"] == TINY_TOKENS, f"{prompt!r}: {t}"
        args = () if chat else ("--ignore-chat-template",)
        assert want == generate_text(prompt, TINY_TOKENS, "--model", TINY_TARGET, *args), prompt
        assert stream(prompt, PLAIN) == want, f"{prompt!r}: plain streaming differs from plain"
        for extra in (None, drafting("model", 3), {"num_draft_tokens": TINY_BLOCK}):
            got, doc = whole(prompt, extra)
            assert got == want, f"{prompt!r} {extra}: DSpark output differs from plain"
            t = timings(doc)
            assert t["draft_n"] > 0 and t["draft_n_accepted"] > 0, f"{prompt!r} {extra}: did not draft: {t}"
            assert t["predicted_n"] == TINY_TOKENS, t
            assert stream(prompt, extra) == want, f"{prompt!r} {extra}: DSpark streaming differs from plain"


def test_seeded_sampling_is_reproducible_and_lossless(server):
    sampled = dict(temperature=0.9, top_p=0.95, seed=1234)
    want = chat_text(server, FREE, 16, extra_body=PLAIN, **sampled)
    assert chat_text(server, FREE, 16, extra_body=PLAIN, **sampled) == want
    assert chat_text(server, FREE, 16, extra_body=drafting("suffix"), **sampled) == want
    assert chat_text(server, FREE, 16, extra_body=drafting("ngram"), **sampled) == want
    got, _ = chat_stream(server, FREE, 16, **drafting("ngram"), **sampled)
    assert got == want
    # another seed samples other text (with overwhelming probability at temperature 0.9)
    assert chat_text(server, FREE, 16, extra_body=PLAIN, temperature=0.9, top_p=0.95, seed=1) != want


# ---------------------------------------------------------------------------------------------
# stop strings and logprobs


def _stop_cases(server):
    text = plain(server, GROUNDED)
    words = [w for w in text.replace("\n", " ").split(" ") if len(w) >= 4]
    assert len(words) >= 3, text
    return text, words


@pytest.mark.parametrize("kind", ["none", "ngram"])
def test_stop_strings(server, kind):
    text, words = _stop_cases(server)
    body = PLAIN if kind == "none" else drafting(kind, 8)
    # a single stop string from the middle of the text; the output is the text before it
    stop = words[len(words) // 2]
    want = text[: text.index(stop)]
    doc, _ = chat_raw(server, GROUNDED, TOKENS, stop=stop, extra_body=body)
    assert doc["choices"][0]["message"]["content"] == want
    assert doc["choices"][0]["finish_reason"] == "stop"
    got, chunks = chat_stream(server, GROUNDED, TOKENS, stop=stop, **body)
    assert got == want, "streamed text: stop text excluded and nothing past it released"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # a list: the earliest match wins; a stop string that spans tokens (two words)
    a, b = words[1], words[-1]
    want2 = text[: min(text.index(a), text.index(b))]
    got, _ = chat_stream(server, GROUNDED, TOKENS, stop=[b, a], **body)
    assert got == want2
    two = text[text.index(words[2]) :][: len(words[2]) + 3]
    got, _ = chat_stream(server, GROUNDED, TOKENS, stop=[two], **body)
    assert got == text[: text.index(two)]
    # usage counts only what was sent
    assert doc["usage"]["completion_tokens"] <= timings(doc)["predicted_n"] + 1


def test_logprobs(server):
    doc, parsed = chat_raw(server, FREE, 8, logprobs=True, top_logprobs=3, extra_body=PLAIN)
    content = doc["choices"][0]["logprobs"]["content"]
    assert len(content) == doc["usage"]["completion_tokens"]
    assert "".join(e["token"] for e in content) == doc["choices"][0]["message"]["content"]
    for e in content:
        assert e["logprob"] <= 0 and len(e["top_logprobs"]) == 3
        tops = [t["logprob"] for t in e["top_logprobs"]]
        assert tops == sorted(tops, reverse=True)
        # greedy: the emitted token is the most likely one
        assert abs(e["logprob"] - tops[0]) < 1e-4, e
    assert parsed.choices[0].logprobs.content[0].token == content[0]["token"]
    # with drafting: the same tokens and the target's log-probabilities
    doc2, _ = chat_raw(server, FREE, 8, logprobs=True, top_logprobs=3, extra_body=drafting("ngram"))
    content2 = doc2["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content2] == [e["token"] for e in content]
    for a, b in zip(content, content2):
        assert abs(a["logprob"] - b["logprob"]) < 1e-3, (a, b)
    # streamed: one entry per token, the same tokens
    _, chunks = chat_stream(server, FREE, 8, logprobs=True, top_logprobs=2)
    streamed = [e for c in chunks for ch in c["choices"] for e in ((ch.get("logprobs") or {}).get("content") or [])]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    # legacy completions: logprobs as an integer
    cdoc, _ = completion_raw(server, "The capital of France is", 4, logprobs=2)
    lp = cdoc["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == cdoc["usage"]["completion_tokens"]
    assert all(len(t) <= 2 for t in lp["top_logprobs"])


# ---------------------------------------------------------------------------------------------
# prompt cache


@pytest.fixture(scope="module")
def cold_server():
    """No prompt cache: the reference for cold runs."""
    s = Server(["--served-model-name", SERVED, "--prompt-cache-size", "0"])
    yield s
    s.stop()


def test_second_turn_reuses_the_prefix_and_still_drafts(server, cold_server):
    turn1 = [{"role": "user", "content": GROUNDED}]
    doc1, _ = chat_raw(server, None, TOKENS, messages=turn1, extra_body=drafting("ngram"))
    reply = doc1["choices"][0]["message"]["content"]
    turn2 = turn1 + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Now repeat the same list again, exactly as before."},
    ]
    doc2, _ = chat_raw(server, None, TOKENS, messages=turn2, extra_body=drafting("ngram"))
    t = timings(doc2)
    cached = doc2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > doc1["usage"]["prompt_tokens"] // 2, (cached, doc1["usage"])
    assert t["cache_n"] == cached and t["prompt_n"] == doc2["usage"]["prompt_tokens"] - cached
    assert t["draft_n"] > 0 and t["draft_n_accepted"] > 0, f"no drafting on the cached turn: {t}"
    cold, _ = chat_raw(cold_server, None, TOKENS, messages=turn2, extra_body=PLAIN)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert doc2["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    # a cancelled (stopped early) request leaves the cache consistent: the same turn again
    words = [w for w in cold["choices"][0]["message"]["content"].split() if len(w) >= 4]
    if words:
        chat_raw(server, None, TOKENS, messages=turn2, stop=words[0], extra_body=drafting("ngram"))
    doc3, _ = chat_raw(server, None, TOKENS, messages=turn2, extra_body=drafting("suffix"))
    assert doc3["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert doc3["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]


BUDGET = 30_000_000


@pytest.fixture(scope="module")
def budget_server():
    s = Server(["--served-model-name", SERVED, "--prompt-cache-bytes", BUDGET])
    yield s
    s.stop()


def _cache_bytes(samples):
    names = sorted({n for n, _ in samples if "cache" in n and "bytes" in n})
    assert names, f"no prompt-cache bytes metric: {sorted({n for n, _ in samples})}"
    return metric(samples, names[0])


def test_byte_budget_holds_under_distinct_prompts(budget_server):
    # ~70-token prompts; an entry holds the f32 KV arrays as allocated (~46 kB per position,
    # 30 layers x 2 x 3 heads x 64 x 4 bytes, in steps of 256 positions: ~12 MB), so a 30 MB
    # budget keeps two, and the later prompts must evict
    seen = []
    for i in range(5):
        prompt = f"Document {i}: " + " ".join(f"item{i}-{j}" for j in range(16)) + ". Summarize it."
        doc, _ = completion_raw(budget_server, prompt, 2, extra_body=PLAIN)
        b = _cache_bytes(budget_server.metrics())
        seen.append(b)
        assert b <= BUDGET, f"prompt cache holds {b} bytes, budget {BUDGET}"
    assert max(seen) > 0, "nothing was ever cached"


# ---------------------------------------------------------------------------------------------
# concurrency


def test_eight_clients_ten_requests_each(server):
    # 12 request kinds: chat and completions, prompts of 5 to 40 tokens, 2 to 8 tokens out,
    # plain / suffix / n-gram, streamed and not; each client walks through them in its order
    prompts = [
        ("chat", FREE),
        ("text", "The capital of France is"),
        ("text", "1, 2, 3, 4,"),
        ("text", "def fibonacci(n):\n    if n < 2:\n        return n\n    return"),
    ]
    bodies = [PLAIN, drafting("suffix"), drafting("ngram")]
    specs = [(*prompts[i % 4], [2, 4, 8][i % 3], bodies[i % 3]) for i in range(12)]

    def call(kind, prompt, n, body, stream):
        if kind == "chat" and stream:
            text, chunks = chat_stream(server, prompt, n, **body)
        elif kind == "chat":
            doc, _ = chat_raw(server, prompt, n, extra_body=body)
            return doc["choices"][0]["message"]["content"], timings(doc)
        elif stream:
            text, chunks = completion_stream(server, prompt, n, **body)
        else:
            doc, _ = completion_raw(server, prompt, n, extra_body=body)
            return doc["choices"][0]["text"], timings(doc)
        return text, next((ch["timings"] for ch in reversed(chunks) if ch.get("timings")), None)

    want = {i: call(*spec, stream=False)[0] for i, spec in enumerate(specs)}
    before = server.metrics()
    results = []
    lock = threading.Lock()

    def client_loop(c):
        for r in range(10):
            i = (c * 5 + r) % len(specs)
            text, t = call(*specs[i], stream=(c + r) % 2 == 0)
            with lock:
                results.append((i, text, t))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(client_loop, range(8)))
    assert len(results) == 80
    for i, text, _ in results:
        assert text == want[i], (specs[i], text, want[i])
    after = server.metrics()

    def delta(name):
        return metric(after, name) - metric(before, name)

    ts = [t for *_, t in results]
    assert all(t is not None for t in ts), "a streamed response without timings: no per-response sums"
    assert delta("mlx_spec:generation_tokens_total") == sum(t["predicted_n"] for t in ts)
    assert delta("mlx_spec:prompt_tokens_total") == sum(t["prompt_n"] + t["cache_n"] for t in ts)
    assert delta("mlx_spec:prompt_tokens_cached_total") == sum(t["cache_n"] for t in ts)
    assert delta("mlx_spec:spec_decode_num_draft_tokens_total") == sum(t["draft_n"] for t in ts)
    assert delta("mlx_spec:spec_decode_num_accepted_tokens_total") == sum(t["draft_n_accepted"] for t in ts)
    assert delta("mlx_spec:request_success_total") == 80
    assert metric(after, "mlx_spec:num_requests_running") == 0
    assert metric(after, "mlx_spec:num_requests_waiting") == 0


def test_metrics_names(server):
    samples = server.metrics()
    names = {n for n, _ in samples}
    text = httpx.get(f"{server.url}/metrics").text
    for base in [
        "mlx_spec:num_requests_running",
        "mlx_spec:num_requests_waiting",
        "mlx_spec:prompt_tokens",
        "mlx_spec:generation_tokens",
        "mlx_spec:prefix_cache_queries",
        "mlx_spec:prefix_cache_hits",
        "mlx_spec:time_to_first_token_seconds",
        "mlx_spec:inter_token_latency_seconds",
        "mlx_spec:e2e_request_latency_seconds",
        "mlx_spec:request_queue_time_seconds",
        "mlx_spec:spec_decode_num_drafts",
        "mlx_spec:spec_decode_num_draft_tokens",
        "mlx_spec:spec_decode_num_accepted_tokens",
        "mlx_spec:spec_decode_num_accepted_tokens_per_pos",
    ]:
        assert any(n == base or n.startswith(base + "_") for n in names) or base in text, base
    assert any("cached" in n for n in names), "cached prompt tokens metric"
    assert any("cache" in n and "bytes" in n for n in names), "cache bytes metric"
    assert any("fallback" in n for n in names), "fallbacks metric"


# ---------------------------------------------------------------------------------------------
# cancellation


def _running(server):
    return metric(server.metrics(), "mlx_spec:num_requests_running")


def _short_latency(server):
    t0 = time.monotonic()
    chat_text(server, "hi", 2, extra_body=PLAIN)
    return time.monotonic() - t0


def test_disconnect_in_decode_stops_the_work(server):
    baseline = min(_short_latency(server) for _ in range(2))
    body = {
        "model": SERVED,
        "messages": [{"role": "user", "content": "Count from 1 to 500, one number per line."}],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
        **drafting("ngram"),
    }
    with httpx.Client(base_url=server.url, timeout=60) as h:
        with h.stream("POST", "/v1/chat/completions", json=body) as r:
            got = 0
            for line in r.iter_lines():
                if line.startswith("data:"):
                    got += 1
                if got >= 4:
                    break
        # leaving both blocks closes the connection in the middle of decoding
    t_closed = time.monotonic()
    wait_metric(server, "mlx_spec:num_requests_running", 0, 5)
    stopped_after = time.monotonic() - t_closed
    assert stopped_after < 2, f"requests running back to 0 only after {stopped_after:.2f}s"
    assert _short_latency(server) < baseline + 1.0, "the next request was delayed"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_disconnect_in_prefill_stops_the_work(server, stream):
    # ~4,000 tokens: eight prefill chunks of 512 (about 7 s here; with ~1,300 tokens the
    # prefill ended before the client gave up); the client gives up during the first ones, so
    # the work must stop before the whole prefill is done
    tag = "Streamed" if stream else "Whole"
    long = f"{tag} summary: " + " ".join(f"sentence {i} is about topic {i % 7}." for i in range(400))
    give_up = 0.5
    body = {"model": SERVED, "prompt": long, "max_tokens": 8, "temperature": 0, "stream": stream, **PLAIN}
    t0 = time.monotonic()
    try:
        with httpx.Client(timeout=give_up) as h, h.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            for _ in r.iter_lines():
                pass
    except httpx.TimeoutException:
        pass  # the client gives up during prefill and closes the connection
    wait_metric(server, "mlx_spec:num_requests_running", 0, 600)
    stopped_after = time.monotonic() - t0
    # the whole prefill's time: the same prompt again (what the cancelled request left in
    # the prompt cache is reused; its per-token prefill time is scaled to the whole prompt)
    doc, _ = completion_raw(server, long, 1, extra_body=PLAIN)
    t = timings(doc)
    assert doc["usage"]["prompt_tokens"] > 2 * 512, doc["usage"]
    assert t["prompt_n"] > doc["usage"]["prompt_tokens"] // 3, (
        f"the abandoned request prefilled {t['cache_n']} of {doc['usage']['prompt_tokens']} prompt tokens "
        f"(cached now) and stopped only after {stopped_after:.2f}s"
    )
    full = t["prompt_ms"] / 1e3 * doc["usage"]["prompt_tokens"] / t["prompt_n"]
    # before the whole prefill is done, with a chunk's slack for noticing the disconnect
    assert stopped_after < give_up + 0.8 * full, f"stopped after {stopped_after:.2f}s, whole prefill ~{full:.2f}s"


def test_disconnect_while_queued():
    # a long request holds the engine (--max-batch 1: one running request fills the batch); a
    # second one queued behind it is dropped by its client and must never run: the generated
    # tokens grow by the first one's only
    # long enough (about 3 s here) that the queued request is dropped while this one runs
    server = Server(["--served-model-name", SERVED, "--max-batch", "1"])
    try:
        _disconnect_while_queued(server)
    finally:
        server.stop()


def _disconnect_while_queued(server):
    long = {"model": SERVED, "prompt": "Count from 1 to 1000:", "max_tokens": 300, "temperature": 0, **PLAIN}
    before = server.metrics()
    done = {}

    def first():
        done["r"] = httpx.post(f"{server.url}/v1/completions", json=long, timeout=120)

    th = threading.Thread(target=first)
    th.start()
    time.sleep(0.3)
    try:
        httpx.post(f"{server.url}/v1/completions", json={**long, "max_tokens": 200}, timeout=0.3)
    except httpx.TimeoutException:
        pass
    th.join()
    assert done["r"].status_code == 200
    wait_metric(server, "mlx_spec:num_requests_running", 0, 5)
    wait_metric(server, "mlx_spec:num_requests_waiting", 0, 5)
    after = server.metrics()
    generated = metric(after, "mlx_spec:generation_tokens_total") - metric(before, "mlx_spec:generation_tokens_total")
    assert generated == done["r"].json()["usage"]["completion_tokens"], "the abandoned queued request ran"


def test_concurrent_clients_get_what_they_get_alone(server):
    # continuous batching through the official client: mixed requests sent together return
    # the text (and log-probabilities) each returns alone
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    asks = [
        dict(messages=[{"role": "user", "content": "Name three fruits."}], max_tokens=24, temperature=0),
        dict(messages=[{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog."}],
             max_tokens=24, temperature=0, logprobs=True, top_logprobs=2),
        dict(messages=[{"role": "user", "content": "Write a haiku."}], max_tokens=20, temperature=0.8, seed=3),
        dict(messages=[{"role": "user", "content": "Count to five."}], max_tokens=16, temperature=0,
             extra_body={"num_draft_tokens": 0}),
    ]

    def ask(kw):
        r = client.chat.completions.create(model=SERVED, **kw)
        c = r.choices[0]
        return c.message.content, (c.logprobs.model_dump() if c.logprobs else None)

    alone = [ask(kw) for kw in asks]
    with ThreadPoolExecutor(len(asks)) as pool:
        together = list(pool.map(ask, asks))
    assert together == alone


# ---------------------------------------------------------------------------------------------
# faults and overload


def test_injected_error_and_panic_fail_one_request(server):
    with server.http() as h:
        for fault in ("error", "panic"):
            r = h.post(
                "/v1/chat/completions",
                json={
                    "model": SERVED,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4,
                    "x_test_fault": fault,
                },
            )
            assert r.status_code == 500, (fault, r.status_code, r.text)
            validate(r.json(), "ErrorResponse")
            assert httpx.get(f"{server.url}/health").status_code == 200
            assert chat_text(server, FREE, 4)
    # in a stream: an error event (or a 500 before the first chunk); the client raises
    with pytest.raises(openai.APIError):
        for _ in server.client().chat.completions.create(
            model=SERVED,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=True,
            extra_body={"x_test_fault": "error"},
        ):
            pass
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert chat_text(server, FREE, 4)


def test_the_fault_field_needs_the_flag(cold_server):
    r = httpx.post(
        f"{cold_server.url}/v1/chat/completions",
        json={"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "x_test_fault": "panic"},
        timeout=120,
    )
    assert r.status_code == 400, r.text
    validate(r.json(), "ErrorResponse")
    assert r.json()["error"]["param"] == "x_test_fault"
    assert httpx.get(f"{cold_server.url}/health").status_code == 200


def test_max_queue_one_with_three_parallel_requests():
    # one running (--max-batch 1) and one waiting are admitted, the third gets 503
    s = Server(["--served-model-name", SERVED, "--max-queue", "1", "--max-batch", "1"], wait_healthy=False)
    try:
        # /health: 503 (OpenAI-shaped) while the model loads, then 200
        seen = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            r = httpx.get(f"{s.url}/health", timeout=10)
            seen.append(r.status_code)
            if r.status_code == 503:
                validate(r.json(), "ErrorResponse")
            if r.status_code == 200:
                break
            time.sleep(0.02)
        assert seen[-1] == 200 and set(seen) <= {200, 503}, seen
        body = {"model": SERVED, "prompt": "Count from 1 to 1000:", "max_tokens": 60, "temperature": 0, **PLAIN}
        out = [None] * 3

        def post(i):
            time.sleep(0.15 * i)
            out[i] = httpx.post(f"{s.url}/v1/completions", json=body, timeout=120)

        threads = [threading.Thread(target=post, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        codes = sorted(r.status_code for r in out)
        assert codes == [200, 200, 503], [(r.status_code, r.text[:200]) for r in out]
        rejected = next(r for r in out if r.status_code == 503)
        validate(rejected.json(), "ErrorResponse")
        assert rejected.headers.get("retry-after"), rejected.headers
        # the client sees a 503 as an APIStatusError (it would retry it)
        assert s.health() == 200
    finally:
        s.stop()


@pytest.mark.parametrize("max_batch", ["1", "4"])
def test_dead_engine_turns_health_503_and_fails_the_queue(max_batch):
    # one at a time, the running request finishes before the kill is taken off the queue; in a
    # batch the kill is taken between rounds and the running request fails with the engine
    s = Server(["--served-model-name", SERVED, "--test-faults", "--max-batch", max_batch])
    try:
        long = {"model": SERVED, "prompt": "Count from 1 to 1000:", "max_tokens": 60, "temperature": 0, **PLAIN}
        out = {}

        def post(name, body, delay):
            time.sleep(delay)
            try:
                out[name] = httpx.post(f"{s.url}/v1/completions", json=body, timeout=120)
            except httpx.HTTPError as e:  # a dropped connection is a failure too, not a hang
                out[name] = e

        jobs = [
            ("first", long if max_batch == "1" else {**long, "max_tokens": 300}, 0.0),
            ("kill", {**long, "max_tokens": 4, "x_test_fault": "kill_engine"}, 0.2),
            ("queued", long, 0.4),
        ]
        threads = [threading.Thread(target=post, args=j) for j in jobs]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert time.monotonic() - t0 < 100
        failed = ("kill", "queued")
        if max_batch == "1":
            assert out["first"].status_code == 200, out["first"].text
        else:
            failed += ("first",)
        for name in failed:
            r = out[name]
            assert isinstance(r, httpx.HTTPError) or r.status_code >= 500, (name, r.status_code, r.text)
            if not isinstance(r, httpx.HTTPError):
                validate(r.json(), "ErrorResponse")
        s.wait_health(503, 10)
        r = httpx.post(f"{s.url}/v1/completions", json={**long, "max_tokens": 2}, timeout=10)
        assert r.status_code == 503, r.text
        validate(r.json(), "ErrorResponse")
    finally:
        s.stop()


# ---------------------------------------------------------------------------------------------
# soak slice (the full soak: `cargo xtask soak --requests 10000`)


def test_soak_slice():
    import soak

    n = int(__import__("os").environ.get("MLX_SPEC_SOAK_REQUESTS", "300"))
    report = soak.run(n)
    assert report["ok"], json.dumps(report, indent=1)
