#!/usr/bin/env bash
# Several nodes with torchrun: run this same command on every node; they meet at MASTER_ADDR.
#
#   # on node 0 (its address is 10.0.0.1):   on node 1:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash examples/pretrain_gpt_multi_node.sh
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash examples/pretrain_gpt_multi_node.sh
#
# The c10d rendezvous needs MASTER_PORT open between the nodes; NODE_RANK only orders the nodes.
# Data (once, on a file system every node reads; see pretrain_gpt_single_node.sh):
#   python tools/preprocess_data.py --input corpus.jsonl --output-prefix /shared/data/corpus \
#       --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --append-eod
# then DATA_PREFIX=/shared/data/corpus_text_document VOCAB_FILE=... MERGE_FILE=... (mock data without it).
#
# A rank that dies makes torchrun restart the workers on every node (up to MAX_RESTARTS times, default 3);
# they resume from the latest checkpoint in CHECKPOINT_DIR, which every node must see (a shared file system).
# A node that is lost (or never started) leaves the others waiting in torchrun's rendezvous after their
# error lines, RDZV_TIMEOUT seconds (default 300: the time to start every node), then torchrun ends with
# RendezvousTimeoutError. Ctrl-C ends it sooner; run the command on every node again to resume from
# CHECKPOINT_DIR (with another NNODES too: the sharded checkpoint loads at any data-parallel size).
set -euo pipefail
NNODES=${NNODES:?set NNODES (number of nodes)}
NODE_RANK=${NODE_RANK:?set NODE_RANK (0 .. NNODES-1)}
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR (address of node 0)}
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MAX_RESTARTS=${MAX_RESTARTS:-3}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-checkpoints/gpt-350m}

# Launcher: one torchrun per node, GPUS_PER_NODE processes each; the job id keeps two jobs apart.
LAUNCH_ARGS=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE"
             --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${JOB_ID:-megalite}"
             --max-restarts "$MAX_RESTARTS" --rdzv-conf "join_timeout=${RDZV_TIMEOUT:-300}")

# Data: preprocessed corpus or synthetic tokens.
if [ -n "${DATA_PREFIX:-}" ]; then
    DATA_ARGS=(--data-path "$DATA_PREFIX" --tokenizer-type GPT2BPETokenizer
               --vocab-file "${VOCAB_FILE:?set VOCAB_FILE}" --merge-file "${MERGE_FILE:?set MERGE_FILE}")
else
    DATA_ARGS=(--mock-data --vocab-size 50257)
fi

# Parallelism: tensor parallelism inside a node (NVLink), pipeline across nodes, data parallel the rest.
PARALLEL_ARGS=(--tensor-model-parallel-size "${TP:-2}" --pipeline-model-parallel-size "${PP:-2}" --sequence-parallel
               --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather)

# Model: GPT-2 medium (350M), bf16.
MODEL_ARGS=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16
            --seq-length 2048 --max-position-embeddings 2048 --bf16)

# Batch, optimizer and schedule.
TRAIN_ARGS=(--micro-batch-size 4 --global-batch-size 256 --train-iters 20000
            --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 500
            --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0)

# Logging, evaluation and checkpoints (the checkpoint directory must be shared by the nodes); saving to and
# loading from one directory resumes a restarted job where it saved last.
LOG_ARGS=(--log-interval 10 --eval-interval 1000 --eval-iters 10
          --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval 1000)

exec torchrun "${LAUNCH_ARGS[@]}" "$(dirname "$0")/../pretrain_gpt.py" \
    "${DATA_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${LOG_ARGS[@]}" "$@"
