"""Save and load a whole run: model, optimizer, LR schedule, loss scaler, counters, RNG, config.

::

    SAVE/iter_0000100/                      (written as iter_0000100.tmp, renamed when every rank is done)
      sharded format (default, layout-free, on torch.distributed.checkpoint):
        __<rank>_0.distcp  .metadata        every tensor block once, written by the rank owning it (with the
                                            distributed optimizer: each DP rank its own flat pieces)
        index_<rank>.json                   block -> global tensor name, global shape, offsets, [flat], crc32
        meta.json  rng_<rank>.pt            counters, scheduler, scaler, config; RNG per rank
      torch format (Megatron-LM's legacy layout, same tp/pp/vp to load):
        mp_rank_<tp:02d>[_<pp:03d>]/model_optim_rng.pt (+ .crc32.json: the file's checksum)
    SAVE/latest_checkpointed_iteration.txt  written last (temporary file + rename)
    SAVE/.megalite_lock                     the run saving here (host, pid; held with flock by rank 0)

The rooms: ``manager.py`` (Checkpointer, save_checkpoint, load_checkpoint: the run's
explicit state objects -- one ``run.RunParts`` -- in, files out), ``formats.py`` (the Format
protocol, LoadSource and the FormatRegistry that config, validation, the manager and async
save read instead of format names), ``run_formats.py`` (the sharded and torch formats behind
that protocol), ``async_save.py`` (the snapshot, the writes in the background with
--async-save, publishing once every rank is done), ``protocol.py`` (the atomic tmp -> rename
-> latest protocol, retention, the shared-directory check), ``save_lock.py`` (one run per
--save), ``run_state.py`` (meta.json and its validation, model-shape check, random states),
``sharded.py`` (with its writer ``sharded_write.py`` and reader ``sharded_read.py``) and
``torch_format.py`` (the two formats' files), ``layout.py`` (parameter blocks),
``safe_load.py`` (plain-data reads). Other projects' files (Hugging Face, Megatron-LM legacy
and torch_dist) live in ``megalite/interop``, which registers Megatron-Core's torch_dist as a
load source; nothing here imports it.

The public names below are imported on first use (PEP 562), so that the config package can
read ``formats.py``'s plain data without importing the whole checkpointing room.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "Checkpointer": "manager",
    "save_checkpoint": "manager",
    "load_checkpoint": "manager",
    "RunParts": "run",
    "RUN_FORMATS": "run_formats",
    "FormatRegistry": "formats",
    "LATEST": "protocol",
    "iteration_dir": "protocol",
    "read_latest": "protocol",
    "FORMAT_VERSION": "run_state",
    "SHAPE_FIELDS": "run_state",
    "RandomStates": "run_state",
    "check_model_shape": "run_state",
    "saved_stage_layers": "run_state",
    "stage_counts": "run_state",
    "CheckpointError": "safe_load",
    "legacy_dir": "torch_format",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'megalite.checkpointing' has no attribute {name!r}")
    return getattr(importlib.import_module(f"megalite.checkpointing.{_PUBLIC[name]}"), name)
