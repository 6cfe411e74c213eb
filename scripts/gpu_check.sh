#!/usr/bin/env bash
# GPU checks (CUDA): the bf16 equivalence tests with sdpa/flash kernels and the compiled decode with CUDA graphs
# (tests/kv/test_compile.py -m gpu), then the 32k-token speed check on random-weight models built from real configs
# (Llama-3.1-8B, DeepSeek-V3 MLA), eager vs compiled decode and decode-time eviction included, then the TP decode
# bench over the GPUs visible (scripts/gpu_tp.sh). Writes results/bench/gpu_* and tp.csv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
mkdir -p results/bench
"$PY" -c "import torch; assert torch.cuda.is_available(), 'gpu_check needs CUDA'; print(torch.cuda.get_device_name())"
"$PY" -m pytest -m gpu -q -p no:cacheprovider tests/kv/test_gpu.py tests/kv/test_compile.py \
    tests/kv/test_decode_eviction.py 2>&1 | tee results/bench/gpu_tests.log
"$PY" scripts/gpu_bench.py --tokens "${TOKENS:-32768}" --out results/bench 2>&1 | tee results/bench/gpu_bench.log
# tensor-parallel decode over the GPUs visible (one GPU: the one-process rows alone); results/bench/tp.csv
PY="$PY" bash scripts/gpu_tp.sh
