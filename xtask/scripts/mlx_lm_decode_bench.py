"""mlx-lm side of `cargo xtask bench-decode`: plain decode tokens/s and the verify-window cost
curve t(T) on one model directory, measured exactly as `crates/models/benches/decode.rs`
measures mlx-spec (same prompts, chat template, greedy, float32 compute; T-token forward with
logits for all T on a KV cache filled with the verify prompt, then trimmed back), and with a
`long` prompt in the prompts file (and LONG not 0) prefill tokens/s of it and decode tokens/s
after it (`stream_generate`'s prompt_tps and generation_tps).

    python mlx_lm_decode_bench.py MODEL_DIR PROMPTS_JSON TOKENS REPS [LONG]   # one JSON line
"""
import json
import os
import sys
import time

import mlx.core as mx
from mlx_lm import load, stream_generate
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from other_cores import OtherCores

WINDOWS = [1, 2, 4, 8, 11, 16]
others = OtherCores()

model_dir, prompts_path, tokens, reps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
long_on = len(sys.argv) < 6 or sys.argv[5] != "0"
prompts = json.load(open(prompts_path))
model, tok = load(model_dir)
model.set_dtype(mx.float32)


def chat(p):
    text = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


decode_ids, verify_ids = chat(prompts["decode"]), chat(prompts["verify"])
decode_tps, decode_cpu = [], []
for rep in range(reps + 1):
    last = None
    c0 = time.process_time()
    # no EOS stop, as the Rust side: generate exactly `tokens`
    for r in stream_generate(model, tok, decode_ids, max_tokens=tokens):
        last = r
    if rep > 0:
        decode_tps.append(last.generation_tps)
        decode_cpu.append((time.process_time() - c0) * 1e3 / max(1, last.generation_tokens))

long_ids = chat(prompts["long"]) if "long" in prompts and long_on else []
prefill_tps, long_decode_tps = [], []
for rep in range(reps + 1 if long_ids else 0):
    for r in stream_generate(model, tok, long_ids, max_tokens=tokens):
        last = r
    if rep > 0:
        prefill_tps.append(last.prompt_tps)
        long_decode_tps.append(last.generation_tps)

# Prefill all but the last prompt token (mlx-spec's prefill shape), in chunks of 512.
cache = make_prompt_cache(model)
head = verify_ids[:-1]
for i in range(0, len(head), 512):
    model(mx.array([head[i:i + 512]]), cache=cache)
    mx.eval([c.state for c in cache])
window = list(reversed(verify_ids))[:16]
verify = {str(t): [] for t in WINDOWS}
verify_cpu = {str(t): [] for t in WINDOWS}
for rep in range(reps + 1):
    for t in WINDOWS:
        x = mx.array([window[:t]])
        t0, c0 = time.perf_counter(), time.process_time()
        logits = model(x, cache=cache)
        mx.eval(logits)
        ms = (time.perf_counter() - t0) * 1e3
        cpu_ms = (time.process_time() - c0) * 1e3
        assert trim_prompt_cache(cache, t) == t
        if rep > 0:
            verify[str(t)].append(ms)
            verify_cpu[str(t)].append(cpu_ms)

print(json.dumps({
    "engine": "mlx-lm", "variant": "mlx-lm", "model": model_dir,
    "prompt_tokens": {"decode": len(decode_ids), "verify": len(verify_ids), "long": len(long_ids)},
    "decode_tps": decode_tps, "verify_ms": verify,
    "prefill_tps": prefill_tps, "long_decode_tps": long_decode_tps,
    "decode_cpu_ms_per_token": decode_cpu, "verify_cpu_ms": verify_cpu,
    "ld_preload": os.environ.get("LD_PRELOAD", ""),
    "others_cores": others.value(),
}))
