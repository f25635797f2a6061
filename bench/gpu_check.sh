#!/usr/bin/env bash
# The GPU checks, in one short script, for a machine with an NVIDIA GPU and this repository
# installed (`make install`): greedy exactness and the logprob/quantization tests on CUDA, then the
# offline, quantization and serving benchmarks, then one table. Run it whenever a GPU is at hand
# and record the table in bench/RESULTS.md:
#
#   bash bench/gpu_check.sh            # about 10 minutes on one GPU
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
PYEOF
