#!/usr/bin/env bash
# The external-client serving benchmark with the modes interleaved: every mode is served at once
# (one `dspark serve` per mode, on consecutive ports), and each point (prompt set, temperature,
# concurrency) runs SGLang 0.5.23's bench_serving against mode after mode, so slow drifts of the
# machine fall on all modes alike. Same bench_serving arguments as ../shared/tools/serve-bench.sh.
# Run from the repository root, alone on the machine. Prints SYSTEM SET c=C T=T tps= ttft_ms= tpot_ms= [vpr_round= vpr_step=]
# lines (python -m tools.serve_bench_table reads them).
#   MODES ("off dspark fixed threshold"), CONCS ("1 4 16 64 128"), TEMPS ("0 1"), SETS ("code chat"),
#   MODEL / DRAFT (default: the bundled pair), EXTRA (more `dspark serve` flags), PORT (18790),
#   ROUNDS (1: each point's modes run this many times in turn; the table takes each one's median)
set -u
H=$(cd "$(dirname "$0")/../../shared/tools" 2>/dev/null && pwd) || { echo "needs ../shared/tools" >&2; exit 1; }
read -r PY SITE < <("$H/sglang-bench-env.sh") || { echo "bench_serving env failed" >&2; exit 1; }
MODES=${MODES:-"off dspark fixed threshold"}; CONCS=${CONCS:-"1 4 16 64 128"}; TEMPS=${TEMPS:-"0 1"}
SETS=${SETS:-"code chat"}; EXTRA=${EXTRA:-}; port=${PORT:-18790}; ROUNDS=${ROUNDS:-1}
MODEL=${MODEL:-$(pwd)/dspark_server/assets/demo/target}; DRAFT=${DRAFT:-$(pwd)/dspark_server/assets/demo/draft}
OUT=$(mktemp -d); mkdir -p "$OUT/prompts"
for pair in "code:../shared/prompts/humaneval.jsonl" "chat:../shared/prompts/mt-bench.jsonl"; do
  "$PY" - "${pair#*:}" "$OUT/prompts/${pair%%:*}.jsonl" <<'PYEOF'
import json, sys
with open(sys.argv[2], "w") as o:
    for line in open(sys.argv[1]):
        turn = json.loads(line)["turns"][0]
        o.write(json.dumps({"conversations": [{"content": turn}, {"content": "x x x x"}]}) + "\n")
PYEOF
done
# Draft tokens verified per request and decoding step (Figure 8 of the paper), from the server's
# counters before and after a point: per drafting round (vpr_round), and per request-step
# counting the gate's plain steps as zero (vpr_step; request-steps = rounds + tokens emitted
# outside rounds - one first token per request).
verified() {
  awk -v n="$2" '
    FNR == 1 { file++ }
    /^dspark_spec_decode_num_verified_tokens_total / { v[file] = $2 }
    /^dspark_spec_decode_num_drafts_total / { r[file] = $2 }
    /^dspark_spec_decode_num_emitted_tokens_total / { e[file] = $2 }
    /^dspark_generation_tokens_total / { g[file] = $2 }
    END {
      dv = v[2] - v[1]; dr = r[2] - r[1]; steps = dr + (g[2] - g[1]) - (e[2] - e[1]) - n
      if (dr > 0) printf " vpr_round=%.2f", dv / dr
      if (steps > 0) printf " vpr_step=%.2f", dv / steps
    }' "$1.before.prom" "$1.after.prom"
}
declare -A PORTS; pids=()
for m in $MODES; do
  # shellcheck disable=SC2086
  .venv/bin/dspark serve --host 127.0.0.1 --port "$port" --model "$MODEL" --draft "$DRAFT" --spec-mode "$m" $EXTRA \
    > "$OUT/serve-$m.log" 2>&1 &
  pids+=($!); PORTS[$m]=$port; port=$((port + 1))
done
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
for m in $MODES; do  # /ready: dspark mode profiles the engine at start-up
  for _ in $(seq 1 300); do curl -sf "127.0.0.1:${PORTS[$m]}/ready" >/dev/null && break; sleep 1; done
done
for T in $TEMPS; do for set in $SETS; do for c in $CONCS; do
  n=$(( c == 1 ? 12 : (c <= 16 ? 48 : 2 * c) ))
  for r in $(seq 1 "$ROUNDS"); do for m in $MODES; do
    f=$OUT/$m-$set-c$c-t$T-r$r
    curl -s "127.0.0.1:${PORTS[$m]}/metrics" > "$f.before.prom"
    HF_HUB_OFFLINE=1 PYTHONPATH=$SITE timeout 900 "$PY" -m sglang.bench_serving --backend sglang-oai-chat \
      --base-url "http://127.0.0.1:${PORTS[$m]}" --model "$MODEL" --served-model-name target --tokenizer "$MODEL" \
      --dataset-name custom --dataset-path "$OUT/prompts/$set.jsonl" --sharegpt-context-len 896 --num-prompts $n \
      --sharegpt-output-len 128 --max-concurrency "$c" --request-rate inf --seed 1 \
      --extra-request-body "{\"temperature\": $T}" --output-file "$f.jsonl" > "$f.log" 2>&1
    tps=$(grep -E 'Output token throughput' "$f.log" | awk '{print $NF}')
    ttft=$(grep -E 'Median TTFT' "$f.log" | awk '{print $NF}'); tpot=$(grep -E 'Median TPOT' "$f.log" | awk '{print $NF}')
    curl -s "127.0.0.1:${PORTS[$m]}/metrics" > "$f.after.prom"
    echo "ours-$m $set c=$c T=$T tps=${tps:-0} ttft_ms=${ttft:-0} tpot_ms=${tpot:-0}$(verified "$f" "$n")"
  done; done
done; done; done
