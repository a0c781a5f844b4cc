#!/usr/bin/env bash
# Long context on one node, 8 GPUs, torchrun: a Llama-style 1.3B model on 8192-token sequences, each
# sequence split over a context-parallel group of 4 (CP rank r holds chunks r and 7-r of 8), TP=2 with
# sequence parallelism inside each CP rank: TP x CP = 8, data parallel 1.
#
#   bash examples/pretrain_gpt_long_context.sh                              # ring attention (p2p)
#   CP_COMM_TYPE=a2a bash examples/pretrain_gpt_long_context.sh             # DeepSpeed-Ulysses all-to-all
#   SEQ_LENGTH=32768 CP=8 TP=1 bash examples/pretrain_gpt_long_context.sh --train-iters 100
#
# --cp-comm-type: p2p passes K/V blocks around the CP ring behind the attention compute (no attention
# dropout); all_gather gathers K/V (small with grouped-query attention); a2a needs the heads and query
# groups per TP rank to divide by CP. --seq-length must divide by 2 x CP (x TP with sequence parallelism).
#
# Data (once): documents end with an eod token (--append-eod), then DATA_PREFIX, VOCAB_FILE and MERGE_FILE:
#   python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
#       --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt \
#       --append-eod --workers 16
# Packed documents attend only within themselves, positions restart per document and eod tokens carry no
# loss (--reset-attention-mask --reset-position-ids --eod-mask-loss), across the CP chunks as well.
# Without DATA_PREFIX the run trains on --mock-data (synthetic tokens, no documents).
set -euo pipefail
NPROC=${NPROC:-8}
TP=${TP:-2}
CP=${CP:-4}
CP_COMM_TYPE=${CP_COMM_TYPE:-p2p}
SEQ_LENGTH=${SEQ_LENGTH:-8192}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-checkpoints/gpt-1.3b-long}

# Data: the preprocessed corpus with packed-document masks, or synthetic tokens.
if [ -n "${DATA_PREFIX:-}" ]; then
    DATA_ARGS=(--data-path "$DATA_PREFIX" --split "969,30,1" --tokenizer-type GPT2BPETokenizer
               --vocab-file "${VOCAB_FILE:?set VOCAB_FILE}" --merge-file "${MERGE_FILE:?set MERGE_FILE}"
               --reset-attention-mask --reset-position-ids --eod-mask-loss)
else
    DATA_ARGS=(--mock-data --vocab-size 50257)
fi

# Parallelism: context parallel over CP ranks, tensor parallel with sequence parallelism inside each.
PARALLEL_ARGS=(--context-parallel-size "$CP" --cp-comm-type "$CP_COMM_TYPE"
               --tensor-model-parallel-size "$TP" --sequence-parallel)

# Memory and precision: bf16 with fp32 main weights and grads; ZeRO-1 over data x context parallel ranks.
MEMORY_ARGS=(--bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather)

# Model: 24 layers, hidden 2048, 16 heads in 8 query groups, SwiGLU, RMSNorm, RoPE; no dropout
# (ring attention has none).
MODEL_ARGS=(--num-layers 24 --hidden-size 2048 --num-attention-heads 16
            --group-query-attention --num-query-groups 8 --ffn-hidden-size 5632
            --normalization RMSNorm --swiglu --position-embedding-type rope --rotary-base 500000
            --untie-embeddings-and-output-weights --disable-bias-linear
            --hidden-dropout 0 --attention-dropout 0
            --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH")

# Batch, optimizer and schedule: 64 sequences (512k tokens at 8192) per step.
TRAIN_ARGS=(--micro-batch-size 1 --global-batch-size 64 --train-iters 20000
            --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 500
            --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0)

# Logging, evaluation and checkpoints (a checkpoint saved at one CP size loads at another).
LOG_ARGS=(--log-interval 10 --eval-interval 500 --eval-iters 10
          --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval 1000)

exec torchrun --standalone --nproc-per-node "$NPROC" \
    "$(dirname "$0")/../pretrain_gpt.py" \
    "${DATA_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${MEMORY_ARGS[@]}" "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" \
    "${LOG_ARGS[@]}" "$@"
