#!/usr/bin/env bash
# One-command GPU check (device machine or any CUDA box with this repo's dependencies):
# every method family's client step against the bare timm step (fp32 and bf16, fraction of the bf16 peak), the
# query cache, and a tiny end-to-end run of every registered method on ViT-B/16 at 224 px (server and client
# seconds per round, MB per round). Writes to ${OUT:-benchmarks/results}.
set -euo pipefail
out=${OUT:-benchmarks/results}
export PYTHONUNBUFFERED=1
nvidia-smi -L || true
python3 benchmarks/perf.py --sections server --server-methods all \
    --out "$out/perf_server_cuda.json" 2>&1 | tee "$out/perf_server_cuda.log"
python3 benchmarks/perf.py --sections client,cache --out "$out/perf_cuda.json" 2>&1 | tee "$out/perf_cuda.log"
