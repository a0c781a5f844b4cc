#!/usr/bin/env bash
# A whole 3D-parallel job on one laptop CPU: TP=2 x PP=2 (interleaved, 2 virtual stages) x DP=2
# = 8 gloo processes. The same flags, with a bigger model and --bf16, run on 8 GPUs.
#
#   bash examples/debug_3d_cpu.sh                  # 20 iterations, about a minute on 2 cores
#   TRAIN_ITERS=2 bash examples/debug_3d_cpu.sh    # a smoke run
#   bash examples/debug_3d_cpu.sh --timeline-out runs/3d.json   # extra flags go to pretrain_gpt.py
#
# Data: none to prepare; --mock-data draws the same deterministic batches for every layout. To
# train on text instead, preprocess it once and swap DATA_ARGS for the commented lines below:
#   python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
#       --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --append-eod
set -euo pipefail
TRAIN_ITERS=${TRAIN_ITERS:-20}

# Data: synthetic tokens from a 1024-word vocabulary.
DATA_ARGS=(--mock-data --vocab-size 1024)
# DATA_ARGS=(--data-path data/corpus_text_document --split 969,30,1
#            --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt)

# Parallelism: tensor 2 x pipeline 2 (1 layer per virtual stage: interleaved 1F1B) x data 2 (the rest of 8).
PARALLEL_ARGS=(--distributed-backend gloo
               --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
               --num-layers-per-virtual-pipeline-stage 1)

# Model: a tiny GPT-2 style transformer.
MODEL_ARGS=(--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64)

# Batch and schedule: 16 samples per step = 2 per micro-batch x 4 micro-batches x 2 data-parallel ranks.
TRAIN_ARGS=(--micro-batch-size 2 --global-batch-size 16 --train-iters "$TRAIN_ITERS")

# Logging and evaluation; one intra-op thread per process so 8 processes share the cores.
LOG_ARGS=(--log-interval 5 --eval-interval 10 --eval-iters 2 --num-threads 1)

exec torchrun --standalone --nproc-per-node 8 "$(dirname "$0")/../pretrain_gpt.py" \
    "${DATA_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${LOG_ARGS[@]}" "$@"
