#!/usr/bin/env bash
# The GPU checks, in one short script, for a machine with an NVIDIA GPU and this repository
# installed (`make install`): greedy exactness and the logprob/quantization tests on CUDA, then the
# plan-accuracy table of this GPU's plans (issue 25's GPU half), then the quantization, serving and
# offline benchmarks, then one table. Run it whenever a GPU is at hand and record the tables in
# bench/RESULTS.md:
#
#   bash bench/gpu_check.sh            # about 9 minutes on one GPU
#
# Every step runs under its own time limit (seconds, from the environment: TESTS_S, PLAN_S,
# QUANT_S, SERVE_S, OFFLINE_S; 0 skips a step), in the order of what a short device lease needs
# most, and a failed or timed-out step does not stop the others: each one's output is in
# $OUT/<step>.txt, the exit statuses in $OUT/status.txt, and the script exits non-zero when any
# step failed.
#
# The engine picks CUDA by itself (`device: auto`); the HF references of the tests stay on the CPU
# in fp32, so exactness is checked across devices.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
OUT="${OUT:-bench/out/gpu}"
mkdir -p "$OUT"
: >"$OUT/status.txt"

"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device: this script checks the GPU path")' || exit 2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
"$PY" -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")' |
  tee -a "$OUT/gpu.txt"

# step NAME SECONDS COMMAND...: COMMAND under `timeout SECONDS`, its output in $OUT/NAME.txt.
step() {
  local name="$1" seconds="$2"
  shift 2
  if [ "$seconds" -le 0 ]; then
    echo "$name skipped" >>"$OUT/status.txt"
    return
  fi
  echo "== $name (at most ${seconds}s)"
  local start=$SECONDS rc=0
  timeout --kill-after=10 "$seconds" "$@" 2>&1 | tee "$OUT/$name.txt" || rc=$?
  echo "$name exit=$rc seconds=$((SECONDS - start))" | tee -a "$OUT/status.txt"
}

step tests "${TESTS_S:-240}" "$PY" -m pytest -q -p no:cacheprovider tests/engine/test_exactness.py \
  tests/engine/test_logprobs.py tests/engine/model/test_quantization.py tests/engine/test_engine_behaviour.py

# The GPU the engines take, as the catalog names it; the engine's GPU schemes are none, int8 and
# int4 (w8a8 is CPU-only): none and int8, each with speculation off and ngram, at planned batches
# 1, 3 and 6 (12 engine starts, each a few seconds of requests). The machine is the script's own:
# a case waits at most 10 s for the load the tests above left, and none runs again for contention.
step plan-accuracy "${PLAN_S:-240}" "$PY" -m bench.plan_accuracy --accelerator auto --schemes none,int8 \
  --speculative off,ngram --requests 32 --warmup 4 --max-load 8 --settle 10 --no-repeat-loaded \
  --log-dir "$OUT/plan-accuracy" --output "$OUT/plan-accuracy.json"

step quantization "${QUANT_S:-90}" "$PY" -m bench.quantization --schemes fp32,none,int8,int4 --rounds 1 \
  --output "$OUT/quantization.json"

step serve "${SERVE_S:-90}" "$PY" -m bench.serve --backends kvpilot --rates 4,64 --duration 20 \
  --output "$OUT/serve.json"

# The HF baseline of this one runs on the CPU, so its ratio says little on a GPU machine: last.
step offline "${OFFLINE_S:-60}" "$PY" -m bench.offline --num-requests 32 --hf-batch-size 32 \
  --output "$OUT/offline.json"

"$PY" - "$OUT" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])


def read(name):
    path = out / name
    return json.loads(path.read_text()) if path.exists() else None


gpu = (out / "gpu.txt").read_text().strip().replace("\n", "; ")
tests = out / "tests.txt"
tests = tests.read_text().strip().splitlines()[-1] if tests.exists() and tests.read_text().strip() else "not run"
print(f"\n| check | result |\n| --- | --- |\n| GPU | {gpu} |\n| exactness and engine tests on CUDA | {tests} |")
for line in (out / "status.txt").read_text().splitlines():
    print(f"| step | {line} |")
if quant := read("quantization.json"):
    for batch, medians in quant["medians"].items():
        print(f"| decode tok/s at batch {batch} | " + ", ".join(f"{s} {v:.0f}" for s, v in medians.items()) + " |")
if offline := read("offline.json"):
    for r in offline["results"]:
        print(f"| offline {r['system']} | {r['tokens_per_second']:.1f} tok/s |")
if read("serve.json"):
    print("| serving | see " + str(out / "serve.txt") + " |")
if report := read("plan-accuracy.json"):
    from bench.plan_accuracy import markdown_table

    print(f"\nPlan accuracy on {report['accelerator']['nvidia_smi']['name']} ({report['command']}):\n")
    print(markdown_table([report["runs"][i] for i in report["table"]]))
PYEOF
! grep -v ' exit=0 \| skipped$' "$OUT/status.txt" >&2
