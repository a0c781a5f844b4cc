"""What several test modules share: plain code, no tests and no fixtures (those live in tests/conftest.py).

No test module imports another test module; whatever two of them use lives here, one module per topic:

- ``tests.helpers`` (this file): the repository path and the tiny pretrain_gpt.py flag lists;
- ``parity``: the tiny config, the single-process reference run and the layout run of the parity tests;
- ``convert``, ``convert_moe``, ``megatron_core``: checkpoint conversion (the CLI, trainers to convert,
  logits, Megatron-LM's fixture files, megatron-core's model and args);
- ``bad_inputs``, ``pretrain_cli``, ``faults``: pretrain_gpt.py flag lists, data directories and the
  background torchrun job;
- ``async_save``, ``checkpointing``, ``fast_load``, ``mixed_precision``, ``moe_parity``,
  ``tensor_parallel``, ``cp_attention``: what the one-process tests in tests/unit and the multi-process
  tests in tests/distributed of the same topic both run.

Functions that run on gloo ranks (``run_distributed(fn, ...)``) must be importable in the worker: module
level here or in the test module.
"""

from __future__ import annotations

import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]

# The model every pretrain_gpt.py CLI test trains: 2 layers, hidden 32, 4 heads, sequence 16.
TINY_MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]
# A tiny mock-data run: vocabulary 200, micro-batch 2, global batch 8 (tests add iterations, logging, layout).
TINY_RUN = ["--mock-data", "--vocab-size", "200", *TINY_MODEL, "--micro-batch-size", "2", "--global-batch-size", "8"]
