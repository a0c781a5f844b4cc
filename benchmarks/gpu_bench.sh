#!/usr/bin/env bash
# One command, one GPU, under 8 minutes on an H200: a 1.3B GPT (24 layers, hidden 2048, seq 2048,
# bf16, SDPA flash attention), 30 iterations eager, with selective recompute and with --compile, and a
# plain PyTorch model of the same shape eager and torch.compile'd, then FP8 (hybrid, tensorwise) eager and
# with --compile; prints tokens/s, TFLOP/s, MFU, peak memory (each row from a fresh allocator) and the ratios
# to both plain PyTorch rows.
#
#   bash benchmarks/gpu_bench.sh                     # on a machine with a CUDA GPU
#   bash benchmarks/gpu_bench.sh --peak-tflops 989   # MFU against another peak
#   bash benchmarks/gpu_bench.sh --cpu-smoke         # tiny shape on CPU: checks the script runs
#   bash benchmarks/gpu_bench.sh --rows 0,2,3,4      # some rows only (0-based, in the table's order)
set -euo pipefail
cd "$(dirname "$0")/.."

# torchrun sets RANK, LOCAL_RANK, WORLD_SIZE and the rendezvous a cluster run gets; the script
# builds an NCCL group on them (gloo with --cpu-smoke).
exec torchrun --standalone --nproc-per-node 1 benchmarks/gpu_bench.py "$@"
