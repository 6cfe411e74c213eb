#!/usr/bin/env bash
# Tensor-parallel decode speed on one GPU node (nccl), random weights of real configs (no downloads):
# Llama-3.1-8B (GQA: each rank holds 8/NPROC KV heads) and DeepSeek-V3 MLA (attention and its latent cache
# replicated on every rank, the MLP sharded), a few layers each, one process on GPU 0 first, then NPROC ranks.
# Appends to results/bench/tp.csv (scripts/bench_tp.py). NPROC=1 runs the one-GPU rows alone.
#   bash scripts/gpu_tp.sh                      # NPROC = the GPUs visible (8 on an 8-GPU node)
#   NPROC=1 LAYERS=4 TOKENS=4096 bash scripts/gpu_tp.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
NPROC=${NPROC:-$("$PY" -c "import torch; print(torch.cuda.device_count())")}
TOKENS=${TOKENS:-8192}
NEW=${NEW:-128}
BUDGET=${BUDGET:-1024}
"$PY" -c "import torch; assert torch.cuda.is_available(), 'gpu_tp needs CUDA'; print(torch.cuda.get_device_name())"
mkdir -p results/bench
for arch in llama deepseek_v3; do
  if [ "$arch" = llama ]; then layers=${LAYERS:-8}; else layers=${LAYERS:-4}; fi
  args=(--arch "$arch" --shape real --layers "$layers" --tokens "$TOKENS" --new "$NEW" --budget "$BUDGET"
        --device cuda --dtype bfloat16 --out results/bench)
  CUDA_VISIBLE_DEVICES=0 "$PY" scripts/bench_tp.py "${args[@]}"
  if [ "$NPROC" -gt 1 ]; then
    "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" scripts/bench_tp.py "${args[@]}"
  fi
done 2>&1 | tee -a results/bench/gpu_tp.log
