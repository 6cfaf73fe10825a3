"""mlx-lm's side of `cargo xtask bench spec`: plain greedy decoding vs mlx-lm's speculative
decoding with a draft model (`speculative_generate_step`, what `mlx_lm.generate
--draft-model` runs) on the same prompt set, models and dtype as the Rust arms.

    python mlx_lm_spec.py TARGET DRAFT PROMPTS.jsonl NUM_PROMPTS MAX_TOKENS NUM_DRAFT DTYPE

Prints one JSON line per prompt on stderr and a final JSON line on stdout:
{"grounded": {"plain_tps", "spec_tps", "accepted", "tokens"}, "free": {...}}. Decode
tokens/s count every token after the first over the time after the first token (the first
token's time is prefill, as mlx_lm.generate reports it).
"""
import json
import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step, speculative_generate_step

target_dir, draft_dir, prompts_path, num_prompts, max_tokens, num_draft, dtype = sys.argv[1:8]
num_prompts, max_tokens, num_draft = int(num_prompts), int(max_tokens), int(num_draft)
model, tok = load(target_dir)
draft, _ = load(draft_dir)
if dtype != "stored":
    model.set_dtype(getattr(mx, dtype))
    draft.set_dtype(getattr(mx, dtype))
eos = set(tok.eos_token_ids)
greedy = lambda lp: mx.argmax(lp, axis=-1)


def timed(steps):
    """(tokens after the first, seconds after the first, accepted drafts)."""
    n, accepted, t1 = 0, 0, None
    for item in steps:
        t = int(item[0])
        if t in eos:
            break
        if t1 is None:
            t1 = time.perf_counter()
        else:
            n += 1
        if len(item) == 3 and item[2]:
            accepted += 1
    return n, (time.perf_counter() - t1) if t1 else 0.0, accepted


prompts = [json.loads(l) for l in open(prompts_path) if l.strip()]
out = {}
for kind in ("grounded", "free"):
    sums = {"plain_tokens": 0, "plain_s": 0.0, "spec_tokens": 0, "spec_s": 0.0, "accepted": 0}
    for p in [p for p in prompts if p["kind"] == kind][:num_prompts]:
        ids = mx.array(tok.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True))
        n, s, _ = timed(generate_step(ids, model, max_tokens=max_tokens, sampler=greedy))
        sums["plain_tokens"] += n
        sums["plain_s"] += s
        n2, s2, acc = timed(speculative_generate_step(ids, model, draft, num_draft_tokens=num_draft,
                                                      max_tokens=max_tokens, sampler=greedy))
        sums["spec_tokens"] += n2
        sums["spec_s"] += s2
        sums["accepted"] += acc
        print(json.dumps({"source": p["source"], "plain_tps": n / max(s, 1e-9), "spec_tps": n2 / max(s2, 1e-9)}),
              file=sys.stderr, flush=True)
    out[kind] = {
        "plain_tps": sums["plain_tokens"] / max(sums["plain_s"], 1e-9),
        "spec_tps": sums["spec_tokens"] / max(sums["spec_s"], 1e-9),
        "accepted": sums["accepted"],
        "tokens": sums["spec_tokens"],
    }
print(json.dumps(out))
