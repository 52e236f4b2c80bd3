#!/usr/bin/env bash
# One short check of the SGLang backend on a CUDA machine (hard limit GPU_CHECK_TIMEOUT, 480 s).
#
#   deploy/gpu-check.sh PROMPTS.jsonl [N_EQUALITY_PROMPTS]
#
# 1. environment: GPU, the image's PyTorch sees CUDA, SGLang imports (else `pip install -e .[sglang]`);
# 2. our SGLang argument mapping accepted by SGLang's real ServerArgs;
# 3. the demo pair (dspark_server/assets/demo/{target,draft}) served twice through `dspark serve
#    --backend sglang`: DSpark on, and --spec-mode off (both on the one GPU, a memory share each);
# 4. deploy/gpu_check.py: greedy equality of the two through our OpenAI API (official openai
#    client), then output tokens/s at concurrency 1/16/64 on both, and the spec server's metrics;
# 5. if time is left: `dspark profile --backend sglang` on a short sweep (table -> $OUT).
# Prints a summary; results and server logs go to $OUT (default ./gpu-check-out). Exit status:
# 0 all good, 1 mismatch or failed requests, 2 environment/start-up failure, 124 timed out.
#
# Knobs (env): DTYPE (float32: exact numerics for the equality check; the script falls back to
# bfloat16 if float32 does not start), ATTN (attention backend with float32, default triton),
# MEM (GPU memory share per server, 0.30), MAX_TOKENS (128), CONCURRENCY (1,16,64), PROFILE (1),
# PYTHON (python3), GPU_CHECK_TIMEOUT (480).
set -uo pipefail

if [[ -z "${GPU_CHECK_INNER:-}" ]]; then
  export GPU_CHECK_INNER=1
  exec timeout --kill-after=15 "${GPU_CHECK_TIMEOUT:-480}" bash "$0" "$@"
fi

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PROMPTS=${1:?usage: deploy/gpu-check.sh PROMPTS.jsonl [N_EQUALITY_PROMPTS]}
N=${2:-8}
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/gpu-check-out}
DTYPE=${DTYPE:-float32}
ATTN=${ATTN:-triton}
MEM=${MEM:-0.30}
MAX_TOKENS=${MAX_TOKENS:-128}
CONCURRENCY=${CONCURRENCY:-1,16,64}
PROFILE=${PROFILE:-1}
BUDGET=${GPU_CHECK_TIMEOUT:-480}
DEMO=dspark_server/assets/demo
mkdir -p "$OUT"
PIDS=()

say() { printf '\n[gpu-check %3ds] %s\n' "$SECONDS" "$*"; }
die() { say "FAIL: $*"; exit 2; }
cleanup() {
  for pid in "${PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null; done
  sleep 2
  for pid in "${PIDS[@]}"; do kill -KILL -- "-$pid" 2>/dev/null; done
}
trap cleanup EXIT
trap 'say "timed out"; exit 124' TERM

[[ -f "$PROMPTS" ]] || die "no prompts file $PROMPTS"
[[ -f $DEMO/target/config.json && -f $DEMO/draft/config.json ]] || die "demo pair missing under $DEMO"

say "1. environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || die "nvidia-smi failed"
$PY -c 'import torch; assert torch.cuda.is_available(), "no CUDA"; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))' \
  || die "the image's PyTorch does not see the GPU"
if ! $PY -c 'import sglang' 2>/dev/null; then
  say "installing .[sglang] (SGLang 0.5.23)"
  $PY -m pip install -q -e ".[sglang]" || die "cannot install SGLang (offline machine? use the GPU image)"
fi
$PY -c 'import dspark_server' 2>/dev/null || $PY -m pip install -q --no-deps -e . || die "cannot install dspark-server"
$PY -c 'import sglang, importlib.metadata as m; print("sglang", m.version("sglang"))'

say "2. our ServerArgs mapping against SGLang's real ServerArgs"
$PY - "$DEMO" <<'EOF' || die "ServerArgs rejected our arguments"
import sys
from sglang.srt.server_args import ServerArgs
from dspark_server.backends.sglang_args import SGLangConfig, build_server_kwargs
demo = sys.argv[1]
for mode in ("dspark", "fixed", "off"):
    cfg = SGLangConfig(model_path=f"{demo}/target", draft_path=f"{demo}/draft", spec_mode=mode,
                       sts_path=f"{demo}/calibration.json", max_running=64, max_model_len=2048,
                       mem_fraction_static=0.3)
    sa = ServerArgs(**build_server_kwargs(cfg))
    print(f"  {mode:6s} ok: speculative_algorithm={sa.speculative_algorithm} "
          f"draft={sa.speculative_draft_model_path} sts={sa.speculative_dspark_confidence_sts_path}")
EOF

free_port() { $PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

start_server() {  # name port args...
  local name=$1 port=$2; shift 2
  setsid $PY -m dspark_server.cli serve --backend sglang --model $DEMO/target --port "$port" \
    --max-model-len 2048 --max-running 64 --dtype "$DTYPE" --mem-fraction "$MEM" "$@" \
    >"$OUT/server-$name.log" 2>&1 &
  PIDS+=($!)
}

wait_ready() {  # port timeout_s log
  local deadline=$((SECONDS + $2))
  while (( SECONDS < deadline )); do
    [[ $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$1/ready") == 200 ]] && return 0
    sleep 2
  done
  say "server on :$1 not ready; last log lines:"; tail -n 40 "$3"; return 1
}

launch_pair() {
  local extra=()
  [[ $DTYPE == float32 ]] && extra+=(--attention-backend "$ATTN")
  local spec_args=(--draft $DEMO/draft --spec-mode dspark)
  [[ -f $DEMO/calibration.json ]] && spec_args+=(--calibration $DEMO/calibration.json)
  [[ -n ${SPS_TABLE:-} ]] && spec_args+=(--profile "$SPS_TABLE")
  PORT_SPEC=$(free_port); PORT_OFF=$(free_port)
  start_server spec "$PORT_SPEC" "${spec_args[@]}" "${extra[@]}"
  start_server off "$PORT_OFF" --spec-mode off "${extra[@]}"
  wait_ready "$PORT_SPEC" 240 "$OUT/server-spec.log" && wait_ready "$PORT_OFF" 120 "$OUT/server-off.log"
}

say "3. serving the demo pair through SGLang (dtype $DTYPE): DSpark and --spec-mode off"
if ! launch_pair; then
  if [[ $DTYPE == float32 ]]; then
    cleanup; PIDS=(); DTYPE=bfloat16
    say "float32 did not start; retrying in bfloat16 (equality then only approximate)"
    launch_pair || die "the SGLang servers did not start (logs in $OUT)"
  else
    die "the SGLang servers did not start (logs in $OUT)"
  fi
fi

say "4. greedy equality + bench (concurrency $CONCURRENCY)"
$PY deploy/gpu_check.py --spec "http://127.0.0.1:$PORT_SPEC" --off "http://127.0.0.1:$PORT_OFF" \
  --prompts "$PROMPTS" --n "$N" --max-tokens "$MAX_TOKENS" --concurrency "$CONCURRENCY" \
  --out "$OUT/result.json"
STATUS=$?
cleanup; PIDS=()

LEFT=$((BUDGET - SECONDS))
if [[ $PROFILE == 1 && $LEFT -gt 170 ]]; then
  say "5. dspark profile --backend sglang (short sweep, ${LEFT}s left)"
  timeout $((LEFT - 20)) $PY -m dspark_server.cli profile --backend sglang --model $DEMO/target \
    --draft $DEMO/draft --dtype "$DTYPE" --mem-fraction 0.5 --batch-sizes 1,4,16 \
    --min-steady-seconds 2 --out "$OUT/sps-sglang.json" >"$OUT/profile.log" 2>&1 \
    && { say "profile written:"; $PY -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in ('sample_batch_tokens','sample_steps_per_sec','max_batch_tokens')})" "$OUT/sps-sglang.json"; } \
    || { say "profile failed (see $OUT/profile.log):"; tail -n 20 "$OUT/profile.log"; }
else
  say "5. profile skipped (PROFILE=$PROFILE, ${LEFT}s left)"
fi

say "done in ${SECONDS}s, dtype $DTYPE, status $STATUS (results: $OUT/result.json)"
exit $STATUS
