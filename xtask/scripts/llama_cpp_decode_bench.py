"""llama.cpp side of `cargo xtask bench-decode` (optional: runs when `llama_cpp`, the
llama-cpp-python package, is importable): plain decode tokens/s and the verify-window cost
curve t(T) on a GGUF, measured as `crates/models/benches/decode.rs` measures mlx-spec (same
prompts and chat template, token ids from the paired model directory's tokenizer, greedy,
2 threads). Decode runs with last-token logits; the verify windows with logits for every
position (`logits_all=True`, what a verifier needs); the KV cache is trimmed back after each
window (`Llama.eval` drops positions past `n_tokens`). With a `long` prompt in the prompts
file: prefill tokens/s of it (batches of 512) and decode tokens/s after it.

    python llama_cpp_decode_bench.py GGUF MODEL_DIR PROMPTS_JSON TOKENS REPS   # one JSON line

On CPUs with AMX, a `GGML_NATIVE=ON` build of llama.cpp crashes in its AMX buffer on some VMs
(`../shared/research/cpu-anchors.md`); build with `GGML_NATIVE=OFF` and explicit AVX flags.
"""
import json
import os
import sys
import time

import llama_cpp
import numpy as np
from transformers import AutoTokenizer

from other_cores import OtherCores

WINDOWS = [1, 2, 4, 8, 11, 16]
others = OtherCores()
gguf, model_dir, prompts_path = sys.argv[1], sys.argv[2], sys.argv[3]
tokens, reps = int(sys.argv[4]), int(sys.argv[5])
prompts = json.load(open(prompts_path))
tok = AutoTokenizer.from_pretrained(model_dir)
threads = int(os.environ.get("MLX_SPEC_BENCH_THREADS", os.cpu_count() or 1))


def chat(p):
    text = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def load(logits_all):
    return llama_cpp.Llama(model_path=gguf, n_ctx=4096, n_batch=512, n_threads=threads, n_threads_batch=threads,
                           logits_all=logits_all, seed=0, verbose=False)


decode_ids, verify_ids = chat(prompts["decode"]), chat(prompts["verify"])
long_ids = chat(prompts["long"]) if "long" in prompts else []
llm = load(False)


def next_token():
    """Greedy next token from the last evaluated position's logits (without logits_all,
    llama-cpp-python keeps no scores: the context holds the one output row)."""
    return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))


def run(ids):
    """Prefill `ids`, then greedy decode: (prompt tokens/s, decode tokens/s, CPU ms a token)."""
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    nxt = next_token()
    prompt_tps = len(ids) / (time.perf_counter() - t0)
    # as mlx-lm's generation_tps: the first token comes from the prompt pass, then tokens - 1 steps
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(tokens - 1):
        llm.eval([nxt])
        nxt = next_token()
    wall = time.perf_counter() - t0
    return prompt_tps, (tokens - 1) / wall, (time.process_time() - c0) * 1e3 / (tokens - 1)


decode_tps, decode_cpu, prefill_tps, long_decode_tps = [], [], [], []
for rep in range(reps + 1):
    _, tps, cpu = run(decode_ids)
    if rep > 0:
        decode_tps.append(tps)
        decode_cpu.append(cpu)
for rep in range(reps + 1 if long_ids else 0):
    ptps, tps, _ = run(long_ids)
    if rep > 0:
        prefill_tps.append(ptps)
        long_decode_tps.append(tps)
del llm

llm = load(True)
llm.reset()
llm.eval(verify_ids[:-1])
base = llm.n_tokens
window = list(reversed(verify_ids))[:16]
verify = {str(t): [] for t in WINDOWS}
verify_cpu = {str(t): [] for t in WINDOWS}
for rep in range(reps + 1):
    for t in WINDOWS:
        t0, c0 = time.perf_counter(), time.process_time()
        llm.eval(window[:t])
        ms = (time.perf_counter() - t0) * 1e3
        cpu_ms = (time.process_time() - c0) * 1e3
        llm.n_tokens = base
        if rep > 0:
            verify[str(t)].append(ms)
            verify_cpu[str(t)].append(cpu_ms)

print(json.dumps({
    "engine": "llama.cpp", "variant": "llama.cpp", "model": model_dir, "gguf": gguf,
    "llama_cpp_version": llama_cpp.__version__, "threads": threads,
    "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
    "prompt_tokens": {"decode": len(decode_ids), "verify": len(verify_ids), "long": len(long_ids)},
    "decode_tps": decode_tps, "verify_ms": verify,
    "prefill_tps": prefill_tps, "long_decode_tps": long_decode_tps,
    "decode_cpu_ms_per_token": decode_cpu, "verify_cpu_ms": verify_cpu,
    "others_cores": others.value(),
}))
