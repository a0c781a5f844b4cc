#!/usr/bin/env bash
# A Mixtral-style mixture of experts on one node, 8 GPUs, torchrun: 8 experts per layer, top-2 routing,
# experts split over an expert-parallel group of 4 (each rank holds 2 experts of every layer), TP=2 with
# sequence parallelism for attention and the router, so ETP x EP x expert-DP = 1 x 4 x 2 = TP x DP = 8.
#
#   bash examples/pretrain_mixtral_moe.sh                                   # alltoall dispatch
#   DISPATCHER=allgather bash examples/pretrain_mixtral_moe.sh
#   EP=8 TP=1 bash examples/pretrain_mixtral_moe.sh --train-iters 100       # one expert per rank and layer
#
# Balancing: the GShard/Switch load-balancing loss (--moe-aux-loss-coeff) and the router z-loss; the log line
# reports both (load_balancing_loss, z_loss) with the tokens each expert received. DeepSeek-V3's
# auxiliary-loss-free balancing instead: --moe-router-score-function sigmoid --moe-router-enable-expert-bias
# --moe-router-load-balancing-type none. Dropless by default; --moe-expert-capacity-factor 1.25 drops the
# tokens beyond 1.25 x the even share of each expert (--moe-token-drop-policy probs|position).
#
# Data (once), then DATA_PREFIX and TOKENIZER_MODEL (a SentencePiece or Hugging Face tokenizer):
#   python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
#       --tokenizer-type HuggingFaceTokenizer --tokenizer-model path/to/tokenizer --append-eod --workers 16
# Without DATA_PREFIX the run trains on --mock-data (synthetic tokens).
set -euo pipefail
NPROC=${NPROC:-8}
TP=${TP:-2}
EP=${EP:-4}
DISPATCHER=${DISPATCHER:-alltoall}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-checkpoints/mixtral-moe}

if [ -n "${DATA_PREFIX:-}" ]; then
    DATA_ARGS=(--data-path "$DATA_PREFIX" --split "969,30,1" --tokenizer-type HuggingFaceTokenizer
               --tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL}")
else
    DATA_ARGS=(--mock-data --vocab-size 32000)
fi

# Parallelism: TP (with sequence parallelism: MoE with TP > 1 needs it) for the dense parts, EP for the
# experts (expert tensor parallelism 1: each expert whole on one rank), the rest data parallel.
PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --sequence-parallel
               --expert-model-parallel-size "$EP" --expert-tensor-parallel-size 1
               --moe-token-dispatcher-type "$DISPATCHER")

# Memory and precision: bf16 with fp32 main weights; ZeRO-1 (dense weights over data parallel, expert
# weights over expert data parallel).
MEMORY_ARGS=(--bf16 --use-distributed-optimizer --overlap-grad-reduce)

# Model: a scaled-down Mixtral (hidden 2048, 16 layers; Mixtral-8x7B is hidden 4096, 32 layers, ffn 14336).
MODEL_ARGS=(--num-layers 16 --hidden-size 2048 --num-attention-heads 16
            --group-query-attention --num-query-groups 8 --ffn-hidden-size 7168
            --normalization RMSNorm --swiglu --position-embedding-type rope --rotary-base 1000000
            --untie-embeddings-and-output-weights --disable-bias-linear
            --hidden-dropout 0 --attention-dropout 0 --seq-length 4096 --max-position-embeddings 4096
            --num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss
            --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 --moe-grouped-gemm)

TRAIN_ARGS=(--micro-batch-size 1 --global-batch-size 128 --train-iters 20000
            --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 500
            --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0)

# Logging, evaluation and checkpoints (sharded: loads into any TP/PP/EP/ETP/DP layout).
LOG_ARGS=(--log-interval 10 --eval-interval 500 --eval-iters 10 --moe-per-layer-logging
          --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval 1000)

exec torchrun --standalone --nproc-per-node "$NPROC" \
    "$(dirname "$0")/../pretrain_gpt.py" \
    "${DATA_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${MEMORY_ARGS[@]}" "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" \
    "${LOG_ARGS[@]}" "$@"
