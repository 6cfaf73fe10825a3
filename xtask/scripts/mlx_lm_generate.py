"""One mlx-lm generation with the same settings as `mlx-spec generate`, printing the stats
as JSON (the baseline side of `cargo xtask bench-generate`).

    python mlx_lm_generate.py MODEL_DIR PROMPT MAX_TOKENS DTYPE [raw]   # DTYPE: stored | float32

`raw` feeds the prompt as plain text (`tok.encode(prompt)`, BOS added) instead of through the
chat template, as `mlx-spec generate --ignore-chat-template` does.
"""
import json
import sys

import mlx.core as mx
from mlx_lm import load, stream_generate

model_dir, prompt, max_tokens, dtype = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
raw = sys.argv[5:6] == ["raw"]
model, tok = load(model_dir)
if dtype != "stored":
    model.set_dtype(getattr(mx, dtype))
if raw:
    ids = tok.encode(prompt)
else:
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
last = None
out = []
for r in stream_generate(model, tok, ids, max_tokens=max_tokens):
    out.append(r.text)
    last = r
print(json.dumps({
    "prompt_tokens": last.prompt_tokens, "prompt_tps": last.prompt_tps,
    "generation_tokens": last.generation_tokens, "generation_tps": last.generation_tps,
    "peak_memory_bytes": int(last.peak_memory * 1e9), "text": "".join(out),
}))
