# Sourced by the figure scripts: paths every benchmark shares (override any of them from the
# environment, e.g. `OUT=/tmp/b benchmarks/serving_sweep.sh`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Prompt files: the published figures used evaluation sets (HumanEval, MBPP, GSM8K, MT-Bench as
# {"turns": [...]} JSONL, one file per set) from a directory PROMPTS you provide. Without PROMPTS
# every script runs on the dozen example prompts in benchmarks/prompts/ (from a fresh clone).
PROMPTS="${PROMPTS:-}"
prompts() {  # `prompts humaneval mt-bench` -> the comma-separated --prompts value
  if [[ -z "$PROMPTS" ]]; then echo "$ROOT/benchmarks/prompts/examples.jsonl"; return; fi
  local files=() name
  for name in "$@"; do files+=("$PROMPTS/$name.jsonl"); done
  (IFS=,; echo "${files[*]}")
}
OUT="${OUT:-$ROOT/runs/bench}"
DEMO="$ROOT/dspark_server/assets/demo"
DSPARK="${DSPARK:-dspark}"
PY="${PYTHON:-python}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # the tools/ scripts: python -m tools.NAME
