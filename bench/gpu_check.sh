#!/usr/bin/env bash
# The GPU checks, in one short script, for a machine with an NVIDIA GPU and this repository
# installed (`make install`): greedy exactness and the logprob/quantization tests on CUDA, then the
# offline, quantization and serving benchmarks, then the plan-accuracy table of this GPU's plans
# (issue 25's GPU half), then one table. Run it whenever a GPU is at hand and record the tables in
# bench/RESULTS.md:
#
#   bash bench/gpu_check.sh            # about 15 minutes on one GPU (plan accuracy: about 5 of them)
#
# The engine picks CUDA by itself (`device: auto`); the HF references of the tests stay on the CPU
# in fp32, so exactness is checked across devices.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
OUT="${OUT:-bench/out/gpu}"
mkdir -p "$OUT"

"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device: this script checks the GPU path")'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

echo "== exactness and engine behaviour on CUDA"
"$PY" -m pytest -q tests/engine/test_exactness.py tests/engine/test_logprobs.py tests/engine/test_quantization.py \
  tests/engine/test_engine_behaviour.py 2>&1 | tee "$OUT/tests.txt"

echo "== offline: engine vs HF static batches"
"$PY" -m bench.offline --output "$OUT/offline.json" | tee "$OUT/offline.txt"

echo "== decode speed per quantization scheme"
"$PY" -m bench.quantization --output "$OUT/quantization.json" | tee "$OUT/quantization.txt"

echo "== serving: Poisson arrivals against kvpilot serve"
"$PY" -m bench.serve --backends kvpilot --rates 1,4,16,64 --duration 20 --output "$OUT/serve.json" | tee "$OUT/serve.txt"

echo "== plan accuracy: this GPU's plans, predicted beside observed p95 TTFT/TPOT"
# The GPU the engines take, as the catalog names it; the engine's GPU schemes are none, int8 and
# int4 (w8a8 is CPU-only): none and int8, each with speculation off and ngram, at planned batches
# 1, 3 and 6 (12 engine starts, each a few seconds of requests). The machine is the script's own:
# a case waits at most 10 s for the load the tests above left, and none runs again for contention.
# A failure is reported after the summary, so the other checks' results still print.
plan_accuracy=0
rm -f "$OUT/plan-accuracy.json"
"$PY" -m bench.plan_accuracy --accelerator auto --schemes none,int8 --speculative off,ngram \
  --max-load 8 --settle 10 --no-repeat-loaded --log-dir "$OUT/plan-accuracy" --output "$OUT/plan-accuracy.json" \
  2> >(tee "$OUT/plan-accuracy.log" >&2) | tee "$OUT/plan-accuracy.txt" || plan_accuracy=$?

"$PY" - "$OUT" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
gpu = (out / "gpu.txt").read_text().strip()
tests = (out / "tests.txt").read_text().strip().splitlines()[-1]
offline = json.loads((out / "offline.json").read_text())
quant = json.loads((out / "quantization.json").read_text())
print(f"\n| check | result |\n| --- | --- |\n| GPU | {gpu} |\n| exactness and engine tests on CUDA | {tests} |")
for r in offline["results"]:
    print(f"| offline {r['system']} | {r['tokens_per_second']:.1f} tok/s |")
for batch, medians in quant["medians"].items():
    print(f"| decode tok/s at batch {batch} | " + ", ".join(f"{s} {v:.0f}" for s, v in medians.items()) + " |")
print("| serving | see " + str(out / "serve.txt") + " |")
accuracy = out / "plan-accuracy.json"
if accuracy.exists():
    from bench.plan_accuracy import markdown_table

    report = json.loads(accuracy.read_text())
    print(f"\nPlan accuracy on {report['accelerator']['nvidia_smi']['name']} ({report['command']}):\n")
    print(markdown_table([report["runs"][i] for i in report["table"]]))
PYEOF
if [ "$plan_accuracy" -ne 0 ]; then
  echo "plan accuracy FAILED (exit $plan_accuracy): see $OUT/plan-accuracy.log and the engine logs in $OUT/plan-accuracy/" >&2
  exit "$plan_accuracy"
fi
