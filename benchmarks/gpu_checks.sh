#!/usr/bin/env bash
# Every one-GPU check of the open performance work, in parts that each fit a 10-minute command:
#
#   bash benchmarks/gpu_checks.sh tests       # the GPU-only tests (pytest -m gpu): the CUDA kernels against references
#   bash benchmarks/gpu_checks.sh attention   # packed documents and CP blocks (bench_attention_gpu.py, < 5 min)
#   bash benchmarks/gpu_checks.sh moe         # MoE vs dense, grouped GEMM vs loop (bench_moe_gpu.py, ~2 min)
#   bash benchmarks/gpu_checks.sh dense       # the 1.3B: eager, recompute, --compile, FP8, plain peers (gpu_bench.sh)
#   bash benchmarks/gpu_checks.sh fp8loss     # FP8 vs bf16 tokens/s and loss after 200 iterations (bench_fp8.py)
#   bash benchmarks/gpu_checks.sh all         # all of them, one after the other (~20 minutes)
#
# Each part's output is also written to $OUT/gpu_checks_<part>.txt when OUT is set.
set -euo pipefail
cd "$(dirname "$0")/.."

run_part() {
    local part=$1
    echo "=== gpu_checks: $part ($(date -u +%H:%M:%S))"
    case "$part" in
        tests) python -m pytest tests -q -m gpu -p no:cacheprovider ;;
        attention) python benchmarks/bench_attention_gpu.py ;;
        moe) python benchmarks/bench_moe_gpu.py ;;
        dense) bash benchmarks/gpu_bench.sh ;;
        fp8loss) python benchmarks/bench_fp8.py --loss-iters 200 ;;
        *)
            echo "gpu_checks: unknown part '$part' (tests, attention, moe, dense, fp8loss or all)" >&2
            return 2
            ;;
    esac
}

parts=("$@")
if [ ${#parts[@]} -eq 0 ]; then
    echo "usage: bash benchmarks/gpu_checks.sh tests|attention|moe|dense|fp8loss|all ..." >&2
    exit 2
fi
if [ "${parts[0]}" = "all" ]; then
    parts=(tests attention moe dense fp8loss)
fi
for part in "${parts[@]}"; do
    if [ -n "${OUT:-}" ]; then
        run_part "$part" 2>&1 | tee "$OUT/gpu_checks_$part.txt"
    else
        run_part "$part"
    fi
done
