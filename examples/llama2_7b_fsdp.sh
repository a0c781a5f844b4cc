#!/usr/bin/env bash
# Llama-2-7B shape (32 layers, hidden 4096, 32 heads, SwiGLU 11008, RMSNorm, RoPE, 4096 tokens) at
# tensor-parallel size 1 on one node of 8 x 80 GB GPUs: weights, gradients and optimizer state sharded
# over the 8 data-parallel ranks (ZeRO-3 on torch's FSDP2, --data-parallel-sharding-strategy
# optim_grads_params). Per GPU: 16 bytes x 6.7e9 parameters / 8 = 13.5 GB of fp32 weights, fp32
# gradients and Adam moments, plus one layer's gathered bf16 weights and the activations; without
# sharding the same 16 bytes per parameter (107 GB) would not fit in 80 GB at tp 1.
# More nodes: NNODES=2 NODE_RANK=<0|1> MASTER_ADDR=<node 0>, and --num-distributed-optimizer-instances
# 2 keeps the shards (and their gathers) inside each node, replicating across nodes (HSDP).
#
#   bash examples/llama2_7b_fsdp.sh
#
# Data (once): Llama 2's SentencePiece tokenizer (tokenizer.model from Meta's release):
#   python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
#       --tokenizer-type Llama2Tokenizer --tokenizer-model tokenizer.model --append-eod --workers 32
# then DATA_PREFIX=data/corpus_text_document TOKENIZER_MODEL=tokenizer.model.
set -euo pipefail
NNODES=${NNODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

# Launcher: c10d rendezvous at node 0; a node not there within RDZV_TIMEOUT seconds (default 300) ends the
# job with torchrun's RendezvousTimeoutError instead of 600 s of silence.
LAUNCH_ARGS=(--nnodes "$NNODES" --node-rank "${NODE_RANK:-0}" --nproc-per-node "$GPUS_PER_NODE"
             --rdzv-backend c10d --rdzv-endpoint "${MASTER_ADDR:-localhost}:${MASTER_PORT:-29500}"
             --rdzv-conf "join_timeout=${RDZV_TIMEOUT:-300}")

# Data: preprocessed corpus or synthetic tokens (Llama 2's 32000-token vocabulary).
if [ -n "${DATA_PREFIX:-}" ]; then
    DATA_ARGS=(--data-path "$DATA_PREFIX" --tokenizer-type Llama2Tokenizer
               --tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL}")
else
    DATA_ARGS=(--mock-data --vocab-size 32000)
fi

# Model: Llama 2 7B; no biases, untied output layer, no dropout.
MODEL_ARGS=(--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008
            --normalization RMSNorm --norm-epsilon 1e-5 --swiglu
            --position-embedding-type rope --rotary-base 10000
            --untie-embeddings-and-output-weights --disable-bias-linear
            --hidden-dropout 0 --attention-dropout 0
            --seq-length 4096 --max-position-embeddings 4096)

# Parallelism and memory: every rank data parallel, FSDP2 sharding (ZeRO-3), selective recompute; bf16.
PARALLEL_ARGS=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
               --data-parallel-sharding-strategy optim_grads_params --bf16 --recompute-activations)

# Batch and optimizer: 1024 x 4096 = 4M tokens per step, as Llama 2; lr 3e-4, cosine to 10%.
TRAIN_ARGS=(--micro-batch-size 1 --global-batch-size 1024 --train-iters 500000
            --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000
            --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-5 --clip-grad 1.0)

# Logging, evaluation and checkpoints (each rank writes its own shards; they load into any layout).
LOG_ARGS=(--log-interval 10 --eval-interval 1000 --eval-iters 10
          --save "${CHECKPOINT_DIR:-checkpoints/llama2-7b-fsdp}" --save-interval 1000)

exec torchrun "${LAUNCH_ARGS[@]}" "$(dirname "$0")/../pretrain_gpt.py" \
    "${DATA_ARGS[@]}" "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${LOG_ARGS[@]}" "$@"
