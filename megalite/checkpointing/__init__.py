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
explicit state objects in, files out), ``async_save.py`` (the snapshot, the writes in the
background with --async-save, publishing once every rank is done), ``protocol.py`` (the atomic
tmp -> rename -> latest protocol, retention, the shared-directory check), ``save_lock.py`` (one
run per --save), ``run_state.py`` (meta.json and its validation, model-shape check, random
states), ``sharded.py`` (with its writer ``sharded_write.py`` and reader ``sharded_read.py``) and
``torch_format.py`` (the two formats), ``layout.py`` (parameter blocks), ``safe_load.py``
(plain-data reads). Conversion to and from Hugging Face and Megatron-LM lives in
``interchange.py``, ``hf.py``, ``megatron.py``, ``native_io.py`` and the ``torch_dist*.py`` /
``megatron_buckets.py`` modules. This module only re-exports the public names.
"""
from megalite.checkpointing.manager import FORMATS, Checkpointer, load_checkpoint, save_checkpoint
from megalite.checkpointing.protocol import LATEST, iteration_dir, read_latest
from megalite.checkpointing.run_state import (FORMAT_VERSION, SHAPE_FIELDS, RandomStates, check_model_shape,
                                              saved_stage_layers, stage_counts)
from megalite.checkpointing.safe_load import CheckpointError
from megalite.checkpointing.torch_format import legacy_dir

__all__ = ["CheckpointError", "Checkpointer", "save_checkpoint", "load_checkpoint", "FORMATS", "LATEST",
           "iteration_dir", "read_latest", "saved_stage_layers", "stage_counts", "check_model_shape",
           "legacy_dir", "RandomStates", "FORMAT_VERSION", "SHAPE_FIELDS"]
