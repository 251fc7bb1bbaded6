#!/usr/bin/env bash
# Smoke-run aiperf 0.13.0 (a load generator users point at OpenAI servers) against
# `sparkserve serve` on the embedded model, offline, in its own virtualenv (no torch). aiperf needs
# an HF tokenizer it resolves by hub id: the GGUF's tokenizer is exported and placed in the local
# HF cache as `local/smollm2`. (guidellm 0.8.1 also streams against the server without errors, but
# sends no max_tokens, so its requests run to EOS or the context end: slow on a CPU.)
#   bash benchmarks/loadgen.sh        -> benchmarks/results/loadgen_aiperf/
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results
VENV=${LOADGEN_VENV:-/tmp/sparkserve-loadgen}
TOK=${TMPDIR:-/tmp}/sparkserve-smollm2-tokenizer
PORT=${PORT:-31555}
[ -x "$VENV/bin/aiperf" ] || { python3 -m venv "$VENV" && "$VENV/bin/pip" install -q aiperf==0.13.0; }
python - "$TOK" <<'PY'
import os, sys
from transformers import AutoConfig, AutoTokenizer
from sparkserve.embedded import default_model_path
p, out = default_model_path(), sys.argv[1]
AutoTokenizer.from_pretrained(os.path.dirname(p), gguf_file=os.path.basename(p)).save_pretrained(out)
AutoConfig.from_pretrained(os.path.dirname(p), gguf_file=os.path.basename(p)).save_pretrained(out)
PY
HUB=${HF_HOME:-$HOME/.cache/huggingface}/hub/models--local--smollm2
SNAP=$HUB/snapshots/0000000000000000000000000000000000000000
mkdir -p "$HUB/refs" "$SNAP" && printf 0000000000000000000000000000000000000000 > "$HUB/refs/main" && cp "$TOK"/* "$SNAP"/
sparkserve serve --port "$PORT" --served-model-name smollm2 --log-level warning & SERVER=$!
trap 'kill $SERVER 2>/dev/null' EXIT
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
export HF_HUB_OFFLINE=1
"$VENV/bin/aiperf" profile --model smollm2 --url "http://127.0.0.1:$PORT" --endpoint-type chat --streaming \
  --concurrency 4 --request-count 16 --tokenizer local/smollm2 --isl 64 --osl 32 --ui-type none \
  --artifact-dir "$OUT/loadgen_aiperf"
