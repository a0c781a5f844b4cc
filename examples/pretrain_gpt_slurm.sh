#!/usr/bin/env bash
# Multi-node on SLURM: one torchrun per node, rendezvous on the first node.
#SBATCH --job-name=megalite-gpt
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
# Usage: sbatch examples/pretrain_gpt_slurm.sh [extra pretrain_gpt.py flags]
set -euo pipefail
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}
TP=${TP:-8}
PP=${PP:-2}
DATA_ARGS=${DATA_ARGS:---mock-data --vocab-size 50257}

srun torchrun --nnodes "$SLURM_NNODES" --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
    pretrain_gpt.py \
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
    --num-layers 32 --hidden-size 4096 --num-attention-heads 32 \
    --group-query-attention --num-query-groups 8 --ffn-hidden-size 11008 \
    --normalization RMSNorm --swiglu --position-embedding-type rope \
    --untie-embeddings-and-output-weights --disable-bias-linear \
    --hidden-dropout 0 --attention-dropout 0 \
    --seq-length 4096 --max-position-embeddings 4096 \
    --micro-batch-size 1 --global-batch-size 512 \
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000 \
    --train-iters 100000 --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 \
    --log-interval 10 --eval-interval 1000 --eval-iters 10 \
    $DATA_ARGS "$@"
