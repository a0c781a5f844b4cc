#!/usr/bin/env bash
# A whole 3D-parallel job on one laptop CPU: TP=2 x PP=2 (interleaved) x DP=2 = 8 gloo processes.
set -euo pipefail
exec torchrun --standalone --nproc-per-node 8 "$(dirname "$0")/../pretrain_gpt.py" \
    --distributed-backend gloo --mock-data --vocab-size 1024 \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
    --num-layers 4 --num-layers-per-virtual-pipeline-stage 1 \
    --hidden-size 64 --num-attention-heads 4 --seq-length 64 \
    --micro-batch-size 2 --global-batch-size 16 --train-iters 20 --log-interval 5 \
    --eval-interval 10 --eval-iters 2 --num-threads 1 "$@"
