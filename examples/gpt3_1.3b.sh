#!/usr/bin/env bash
# GPT-3 XL (1.3B: 24 layers, hidden 2048, 16 heads, 2048 tokens; GPT-3 paper, table 2.1) on one
# 8-GPU node, or on NNODES nodes with the same command on each (NODE_RANK, MASTER_ADDR, MASTER_PORT).
# Layout from `python tools/plan.py --num-gpus 8 --gpu-memory 80 --model-size gpt3-1.3b
# --global-batch-size 512 --seq-length 2048`: data parallel 8 with ZeRO-1 fits in 13 GiB per GPU.
#
#   bash examples/gpt3_1.3b.sh                                      # 1 node
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash examples/gpt3_1.3b.sh   # (NODE_RANK=1 on the other)
#
# Data (once): GPT-2's BPE vocabulary, as GPT-3 used:
#   python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
#       --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt \
#       --append-eod --workers 32
# then DATA_PREFIX=data/corpus_text_document VOCAB_FILE=gpt2-vocab.json MERGE_FILE=gpt2-merges.txt.
set -euo pipefail
NNODES=${NNODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

# Launcher: c10d rendezvous at node 0 (on one node: localhost); a node not there within RDZV_TIMEOUT seconds
# (default 300) ends the job with torchrun's RendezvousTimeoutError instead of 600 s of silence.
LAUNCH_ARGS=(--nnodes "$NNODES" --node-rank "${NODE_RANK:-0}" --nproc-per-node "$GPUS_PER_NODE"
             --rdzv-backend c10d --rdzv-endpoint "${MASTER_ADDR:-localhost}:${MASTER_PORT:-29500}"
             --rdzv-conf "join_timeout=${RDZV_TIMEOUT:-300}")

# Data: preprocessed corpus or synthetic tokens (GPT-2 vocabulary size).
if [ -n "${DATA_PREFIX:-}" ]; then
    DATA_ARGS=(--data-path "$DATA_PREFIX" --tokenizer-type GPT2BPETokenizer
               --vocab-file "${VOCAB_FILE:?set VOCAB_FILE}" --merge-file "${MERGE_FILE:?set MERGE_FILE}")
else
    DATA_ARGS=(--mock-data --vocab-size 50257)
fi

# Model: GPT-3 XL; learned positions, LayerNorm, GeLU, tied embeddings, dropout 0.1 (GPT-3's choices).
MODEL_ARGS=(--num-layers 24 --hidden-size 2048 --num-attention-heads 16
            --seq-length 2048 --max-position-embeddings 2048
            --hidden-dropout 0.1 --attention-dropout 0.1 --init-method-std 0.02)

# Parallelism and memory: pure data parallelism, ZeRO-1, bf16, flash attention (SDPA).
PARALLEL_ARGS=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --bf16
               --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --attention-backend auto)

# Batch and optimizer: 512 x 2048 = 1M tokens per step, lr 2e-4 (GPT-3 XL), 300B tokens = 286k steps.
TRAIN_ARGS=(--micro-batch-size 4 --global-batch-size 512 --train-iters 286102
            --lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine --lr-warmup-iters 375
            --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0)

# Logging, evaluation and checkpoints.
LOG_ARGS=(--log-interval 10 --eval-interval 1000 --eval-iters 10
          --save "${CHECKPOINT_DIR:-checkpoints/gpt3-1.3b}" --save-interval 2000
          --tensorboard-dir "${TENSORBOARD_DIR:-runs/gpt3-1.3b}")

exec torchrun "${LAUNCH_ARGS[@]}" "$(dirname "$0")/../pretrain_gpt.py" \
    "${DATA_ARGS[@]}" "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${LOG_ARGS[@]}" "$@"
