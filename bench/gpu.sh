#!/usr/bin/env bash
# The GPU run, one prepared script (about 5 minutes on one H200): mmcli against transformers on CUDA.
#  1. parity on the tests' tiny checkpoints: float32 greedy tokens identical, bfloat16 as near float32's
#     logits as transformers' bfloat16 (bench/gpu_parity.py)
#  2. compare_hf's workload scaled to 256 images, 2B shapes, bfloat16: images/s of both, the decode step against
#     weight bytes / measured HBM bandwidth, GPU memory peaks, the engine's input-wait share (bench/compare_hf.py)
# Needs torch with CUDA and transformers installed; `pip install --no-deps --no-build-isolation -e .`
# for mmcli itself (a machine with no package index). Exits with the parity's status, after both.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
start=$(date +%s)
parity=0
timeout 300 python bench/gpu_parity.py 2>&1 | grep -v "Loading weights" || parity=$?
echo "parity: $(( $(date +%s) - start )) s"
timeout 420 python bench/compare_hf.py --device cuda --dtype bfloat16 --images 256 --max-seqs 64 --max-len 512 \
    --hf-batch-sizes "${HF_BATCH_SIZES:-16,64}" --cache-dir "${CACHE_DIR:-/tmp/mmcli-gpu-bench}"
echo "total: $(( $(date +%s) - start )) s"
exit "$parity"
