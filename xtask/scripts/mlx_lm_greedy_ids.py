"""mlx-lm's greedy answers as token ids: the reference of `greedy_agreement`
(`crates/models/examples/greedy_agreement.rs`), which compares mlx-spec's greedy decoding in
each precision with them.

    python mlx_lm_greedy_ids.py MODEL_DIR PROMPTS_JSONL MIN_TOKENS MAX_NEW_TOKENS OUT_JSONL [dequantize]

Prompts: JSON Lines with `prompt` or `turns` (the first turn), through the model's chat
template. Answers are greedy (argmax) in float32, up to MAX_NEW_TOKENS each and stopped at EOS
(not included); prompts are taken in order until the answers hold MIN_TOKENS tokens. Each
output line: {"source": "FILE:N", "prompt": [ids], "answer": [ids]}.

`dequantize` replaces every quantized layer by a dense float32 one with the dequantized
weights (`mlx_lm.utils.dequantize_model`): the same function of the input up to float
summation order, and MLX's dense CPU matmuls are far faster than its quantized ones.
"""
import json
import os
import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step

model_dir, prompts_path, min_tokens, max_new, out_path = sys.argv[1:6]
min_tokens, max_new = int(min_tokens), int(max_new)
model, tok = load(model_dir)
if sys.argv[6:7] == ["dequantize"]:
    from mlx_lm.utils import dequantize_model

    model = dequantize_model(model)
model.set_dtype(mx.float32)
eos = set(tok.eos_token_ids)
total, started = 0, time.time()
tmp = out_path + ".tmp"
with open(prompts_path) as f, open(tmp, "w") as out:
    for n, line in enumerate(f):
        if total >= min_tokens:
            break
        rec = json.loads(line)
        text = rec.get("prompt") or rec["turns"][0]
        chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        ids = tok.encode(chat, add_special_tokens=False)
        answer = []
        for token, _ in generate_step(mx.array(ids), model, max_tokens=max_new, sampler=lambda x: mx.argmax(x, axis=-1)):
            token = int(token)
            if token in eos:
                break
            answer.append(token)
        total += len(answer)
        out.write(json.dumps({"source": f"{os.path.basename(prompts_path)}:{n}", "prompt": ids, "answer": answer}) + "\n")
        print(f"{n}: {len(answer)} tokens, {total} in all, {time.time() - started:.0f} s", file=sys.stderr)
os.replace(tmp, out_path)
