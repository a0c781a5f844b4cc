#!/usr/bin/env bash
# One node, 8 GPUs, torchrun: a GPT-2 small (124M) with TP x PP x DP = 8.
#
#   bash examples/pretrain_gpt_single_node.sh                       # data parallel 8
#   TP=2 PP=2 bash examples/pretrain_gpt_single_node.sh --train-iters 100   # extra flags go to pretrain_gpt.py
#
# Data (once, before training): tokenize a JSONL corpus into .bin/.idx files, then set DATA_PREFIX:
#   python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
#       --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt \
#       --append-eod --workers 16
#   DATA_PREFIX=data/corpus_text_document VOCAB_FILE=gpt2-vocab.json MERGE_FILE=gpt2-merges.txt bash $0
# Without DATA_PREFIX the run trains on --mock-data (synthetic tokens).
#
# A rank that dies makes torchrun restart all of them (up to MAX_RESTARTS times, default 3; 0: the job ends);
# they resume from the latest checkpoint in CHECKPOINT_DIR (--save and --load name the same directory).
set -euo pipefail
NPROC=${NPROC:-8}
MAX_RESTARTS=${MAX_RESTARTS:-3}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-checkpoints/gpt2-124m}
TP=${TP:-1}
PP=${PP:-1}

# Data: the preprocessed corpus and its tokenizer, or synthetic tokens.
if [ -n "${DATA_PREFIX:-}" ]; then
    DATA_ARGS=(--data-path "$DATA_PREFIX" --split "969,30,1" --tokenizer-type GPT2BPETokenizer
               --vocab-file "${VOCAB_FILE:?set VOCAB_FILE}" --merge-file "${MERGE_FILE:?set MERGE_FILE}")
else
    DATA_ARGS=(--mock-data --vocab-size 50257)
fi

# Parallelism: tensor x pipeline from the environment, data parallel over the rest of the 8 GPUs.
# Sequence parallelism splits norms/dropout along the sequence when TP > 1 (ignored at TP = 1).
PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --sequence-parallel)

# Memory and precision: bf16 with fp32 main weights and grads; ZeRO-1 with overlapped communication.
MEMORY_ARGS=(--bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather)

# Model: GPT-2 small (12 layers, hidden 768, 12 heads, 1024 positions).
MODEL_ARGS=(--num-layers 12 --hidden-size 768 --num-attention-heads 12
            --seq-length 1024 --max-position-embeddings 1024)

# Batch, optimizer and schedule: 64 sequences (64k tokens) per step.
TRAIN_ARGS=(--micro-batch-size 4 --global-batch-size 64 --train-iters 5000
            --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 200
            --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0)

# Logging, evaluation and checkpoints (MFU uses the GPU's bf16 peak; --peak-tflops overrides it).
# Saving to and loading from one directory resumes a restarted (or resubmitted) job where it saved last.
LOG_ARGS=(--log-interval 10 --eval-interval 500 --eval-iters 20
          --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval 1000)

exec torchrun --standalone --nproc-per-node "$NPROC" --max-restarts "$MAX_RESTARTS" \
    "$(dirname "$0")/../pretrain_gpt.py" \
    "${DATA_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${MEMORY_ARGS[@]}" "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" \
    "${LOG_ARGS[@]}" "$@"
