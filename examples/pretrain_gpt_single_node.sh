#!/usr/bin/env bash
# One node, all its GPUs (or CPU processes): TP x PP x DP = nproc.
# Usage: NPROC=8 TP=2 PP=2 bash examples/pretrain_gpt_single_node.sh [extra pretrain_gpt.py flags]
set -euo pipefail
NPROC=${NPROC:-$(python -c "import torch; print(max(1, torch.cuda.device_count()))")}
TP=${TP:-1}
PP=${PP:-1}
DATA_ARGS=${DATA_ARGS:---mock-data --vocab-size 50257}
# On GPUs: bf16 with fp32 main weights, ZeRO-1 with overlapped communication, and sequence
# parallelism whenever there is tensor parallelism. On CPU (bf16 matmuls are slow there): fp32.
# MEMORY_ARGS (even empty) replaces these defaults.
if [ -z "${MEMORY_ARGS+set}" ]; then
    MEMORY_ARGS=""
    if [ "$(python -c "import torch; print(int(torch.cuda.is_available()))")" = 1 ]; then
        MEMORY_ARGS="--bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"
        if [ "$TP" -gt 1 ]; then MEMORY_ARGS="$MEMORY_ARGS --sequence-parallel"; fi
    fi
fi

exec torchrun --standalone --nproc-per-node "$NPROC" "$(dirname "$0")/../pretrain_gpt.py" \
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
    --num-layers 12 --hidden-size 768 --num-attention-heads 12 \
    --seq-length 1024 --max-position-embeddings 1024 \
    --micro-batch-size 4 --global-batch-size 64 \
    --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 200 \
    --train-iters 5000 --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 \
    --log-interval 10 --eval-interval 500 --eval-iters 20 \
    $DATA_ARGS $MEMORY_ARGS "$@"
