#!/usr/bin/env bash
# SLURM: one task per node runs torchrun, which starts one process per GPU; rendezvous on the
# first node of the allocation. A Llama-2-7B shape on 2 nodes x 8 GPUs (TP=2, PP=2, DP=4).
#SBATCH --job-name=megalite-llama2-7b
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#
#   sbatch examples/pretrain_gpt_slurm.sh [extra pretrain_gpt.py flags]
#
# Data (once, before sbatch, onto a file system every node reads):
#   python tools/preprocess_data.py --input corpus.jsonl --output-prefix /shared/data/corpus \
#       --tokenizer-type Llama2Tokenizer --tokenizer-model tokenizer.model --append-eod --workers 32
#   DATA_PREFIX=/shared/data/corpus_text_document TOKENIZER_MODEL=tokenizer.model sbatch examples/pretrain_gpt_slurm.sh
#
# A rank that dies makes torchrun restart the workers on every node (up to MAX_RESTARTS times, default 3);
# they resume from the latest checkpoint in CHECKPOINT_DIR (shared by the nodes). A resubmitted job resumes
# from it too.
# A lost node leaves the others waiting in torchrun's rendezvous after their error lines, RDZV_TIMEOUT seconds
# (default 120: srun starts every node at once), then torchrun ends with RendezvousTimeoutError and the job
# step fails; scancel ends it sooner, and resubmitting resumes from CHECKPOINT_DIR.
set -euo pipefail
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MAX_RESTARTS=${MAX_RESTARTS:-3}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-checkpoints/llama2-7b}
# The first host of the allocation (read whole: a pipe into head could fail the script under pipefail).
HOSTS=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
MASTER_ADDR=${HOSTS%%$'\n'*}
MASTER_PORT=${MASTER_PORT:-29500}
# sbatch runs a copy of this script: find the repository from the submit directory.
REPO=${REPO:-${SLURM_SUBMIT_DIR:-.}}

# Launcher: srun starts one torchrun per node (--ntasks-per-node=1); c10d rendezvous keyed by the job id.
LAUNCH_ARGS=(--nnodes "$SLURM_NNODES" --nproc-per-node "$GPUS_PER_NODE"
             --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"
             --max-restarts "$MAX_RESTARTS" --rdzv-conf "join_timeout=${RDZV_TIMEOUT:-120}")

# Data: preprocessed corpus or synthetic tokens.
if [ -n "${DATA_PREFIX:-}" ]; then
    DATA_ARGS=(--data-path "$DATA_PREFIX" --tokenizer-type Llama2Tokenizer
               --tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL}")
else
    DATA_ARGS=(--mock-data --vocab-size 32000)
fi

# Model: Llama-2-7B shape (see llama2_7b.sh).
MODEL_ARGS=(--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008
            --normalization RMSNorm --swiglu --position-embedding-type rope
            --untie-embeddings-and-output-weights --disable-bias-linear
            --hidden-dropout 0 --attention-dropout 0 --seq-length 4096 --max-position-embeddings 4096)

# Parallelism and memory: TP inside a node, PP across nodes, ZeRO-1 data parallelism, bf16.
PARALLEL_ARGS=(--tensor-model-parallel-size "${TP:-2}" --sequence-parallel --pipeline-model-parallel-size "${PP:-2}"
               --bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather)

# Batch and optimizer.
TRAIN_ARGS=(--micro-batch-size 1 --global-batch-size 512 --train-iters 100000
            --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000
            --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0)

# Logging, checkpoints; --exit-signal-handler saves a checkpoint when SLURM sends SIGTERM before the time limit.
LOG_ARGS=(--log-interval 10 --eval-interval 1000 --eval-iters 10 --exit-signal-handler
          --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval 1000)

srun torchrun "${LAUNCH_ARGS[@]}" "$REPO/pretrain_gpt.py" \
    "${DATA_ARGS[@]}" "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${LOG_ARGS[@]}" "$@"
