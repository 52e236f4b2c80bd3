#!/usr/bin/env bash
# One fresh `dspark serve` in MODE (dspark), warmed like a sweep's earlier points (c=1: 12, c=4:
# 48 requests), then c=16 (48 requests), code prompts (HumanEval), temperature T (1): SGLang's
# bench_serving with serve-bench.sh's arguments. Prints each point's output tokens/s and the
# draft gate's steps and rates at loads 8-31 after the c=16 point (what the gate chose there).
# Run from the repository root, alone on the machine; compare MODE=off and MODE=dspark.
set -u
H=$(cd "$(dirname "$0")/../../shared/tools" && pwd) || exit 1
read -r PY SITE < <("$H/sglang-bench-env.sh") || exit 1
MODE=${MODE:-dspark}; T=${T:-1}; PORT=${PORT:-18860}
MODEL=$(pwd)/dspark_server/assets/demo/target
OUT=$(mktemp -d)
"$PY" - ../shared/prompts/humaneval.jsonl "$OUT/code.jsonl" <<'PYEOF'
import json, sys
with open(sys.argv[2], "w") as o:
    for line in open(sys.argv[1]):
        o.write(json.dumps({"conversations": [{"content": json.loads(line)["turns"][0]}, {"content": "x x x x"}]}) + "\n")
PYEOF
.venv/bin/dspark serve --port "$PORT" --spec-mode "$MODE" > "$OUT/serve.log" 2>&1 &
spid=$!
trap 'kill $spid 2>/dev/null; wait $spid 2>/dev/null' EXIT
for _ in $(seq 1 120); do curl -sf "127.0.0.1:$PORT/ready" >/dev/null && break; sleep 1; done
point() {
  HF_HUB_OFFLINE=1 PYTHONPATH=$SITE "$PY" -m sglang.bench_serving --backend sglang-oai-chat \
    --base-url "http://127.0.0.1:$PORT" --model "$MODEL" --served-model-name target --tokenizer "$MODEL" \
    --dataset-name custom --dataset-path "$OUT/code.jsonl" --sharegpt-context-len 896 --num-prompts "$2" \
    --sharegpt-output-len 128 --max-concurrency "$1" --request-rate inf --seed 1 \
    --extra-request-body "{\"temperature\": $T}" 2>&1 | grep -E 'Output token throughput' | sed "s/^/$MODE c=$1: /"
}
point 1 12; point 4 48; point 16 48
curl -s "127.0.0.1:$PORT/metrics" | grep -E '^dspark_(spec_steps_total|draft_gate_tokens_per_second).*running="(8-15|16-31)"'
