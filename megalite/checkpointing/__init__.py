"""Save and load a whole run: model, optimizer, LR schedule, loss scaler, counters, RNG, config.

::

    SAVE/iter_0000100/                      (written as iter_0000100.tmp, renamed when complete)
      sharded format (default, layout-free, on torch.distributed.checkpoint):
        __<rank>_0.distcp  .metadata        every tensor block once, written by the rank owning it
        index_<rank>.json                   block -> global tensor name, global shape, offsets
        meta.json  rng_<rank>.pt            counters, scheduler, scaler, config; RNG per rank
      torch format (Megatron-LM's legacy layout, same tp/pp/vp to load):
        mp_rank_<tp:02d>[_<pp:03d>]/model_optim_rng.pt
    SAVE/latest_checkpointed_iteration.txt  written last (temporary file + rename)

The rooms: ``manager.py`` (Checkpointer, save_checkpoint, load_checkpoint: the run's
explicit state objects in, files out), ``protocol.py`` (the atomic tmp -> rename ->
latest protocol, retention), ``run_state.py`` (meta.json, model-shape check, random
states), ``sharded.py`` (with its writer ``sharded_write.py`` and reader ``sharded_read.py``) and ``torch_format.py`` (the two formats), ``layout.py``
(parameter blocks), ``safe_load.py`` (plain-data reads). Conversion to and from
Hugging Face and Megatron-LM lives in ``interchange.py``, ``hf.py``, ``megatron.py``
and ``native_io.py``. This module only re-exports the public names.
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
