"""Output paths checked before the first iteration.

A run that trains for hours and then fails to write its checkpoint, its
TensorBoard events or its timeline has wasted the hours. Each output the
flags name is probed up front: the directory is created (it would be anyway)
and a scratch file is written and removed in it, which also catches read-only
file systems and permissions that ``os.access`` misjudges (for example as root).
"""

from __future__ import annotations

import os
import tempfile
from typing import List, Optional, Tuple

from megalite.config import Config, ConfigError


def _probe_dir(flag: str, path: str) -> None:
    """Make sure ``path`` is (or can become) a writable directory; ConfigError naming ``flag`` if not."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a file, not a directory; give a directory path")
    parent = path
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent.rstrip(os.sep)) or ("." if not os.path.isabs(path) else os.sep)
    if parent and not os.path.isdir(parent):
        raise ConfigError(f"{flag} {path} cannot be created: {parent} is a file, not a directory; give another path")
    try:
        os.makedirs(path, exist_ok=True)
        fd, scratch = tempfile.mkstemp(prefix=".megalite-write-test-", dir=path)
        os.close(fd)
        os.remove(scratch)
    except OSError as e:
        raise ConfigError(f"{flag} {path} is not writable ({e.strerror or e}); give a writable directory") from None


def _probe_file(flag: str, path: str) -> None:
    """``path`` must be a file we can create or overwrite; its directory is probed like an output dir."""
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a directory; give a file path such as {os.path.join(path, 'out.json')}")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ConfigError(f"{flag} {path} exists and is not writable; give another file path")
    _probe_dir(f"{flag} (its directory)", os.path.dirname(os.path.abspath(path)))


def _logging_outputs(cfg: Config, rank: int) -> List[Tuple[str, str, bool]]:
    """The logging section's outputs this rank writes (TensorBoard, timeline, traces, wandb, snapshot)."""
    lg = cfg.logging
    out: List[Tuple[str, str, bool]] = []
    if lg.tensorboard_dir:
        out.append(("--tensorboard-dir", lg.tensorboard_dir, True))
    if lg.timeline_out:
        out.append(("--timeline-out", lg.timeline_out, False))
    # the traces go to --profile-dir, else --tensorboard-dir (probed above), else ./profile
    if lg.profile and rank in lg.profile_ranks and (lg.profile_dir or not lg.tensorboard_dir):
        out.append(("--profile-dir", lg.profile_dir or "profile", True))
    if lg.wandb_project:
        out.append(("--wandb-save-dir", lg.wandb_save_dir or _under_save(cfg, "wandb"), True))
    if lg.record_memory_history:
        out.append(("--memory-snapshot-path", lg.memory_snapshot_path, False))
    return out


def _under_save(cfg: Config, name: str) -> str:
    """The default ``<--save>/name`` (else ``./name``) of an output that lives beside the checkpoints."""
    return os.path.join(cfg.checkpoint.save, name) if cfg.checkpoint.save else name


def output_dirs(cfg: Config, rank: int) -> List[Tuple[str, str, bool]]:
    """(flag, path, is_dir) for every output this rank will write."""
    out: List[Tuple[str, str, bool]] = []
    if cfg.checkpoint.save:
        out.append(("--save", cfg.checkpoint.save, True))
    # The flight records are written when the job fails, the worst moment to learn the path is bad;
    # the default (<--save>/debug or $TMPDIR) is created only if a failure writes there.
    if cfg.parallel.debug_dir:
        out.append(("--debug-dir", cfg.parallel.debug_dir, True))
    out.extend(_logging_outputs(cfg, rank))
    # Index caches are written by global rank 0 only; the others read them.
    if rank == 0 and cfg.data.data_cache_path and not cfg.data.mock_data:
        out.append(("--data-cache-path", cfg.data.data_cache_path, True))
    return out


def check_output_paths(cfg: Config, rank: Optional[int] = None) -> None:
    """Raise ConfigError (one line naming the flag and the path) for an output that cannot be written.

    Also --load: a missing directory starts from scratch (as Megatron), but a file there is a mistake.
    """
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    load = cfg.checkpoint.load
    if load and os.path.exists(load) and not os.path.isdir(load):
        raise ConfigError(
            f"--load {load} is a file; give the checkpoint directory (the one holding "
            f"latest_checkpointed_iteration.txt)"
        )
    for flag, path, is_dir in output_dirs(cfg, rank):
        (_probe_dir if is_dir else _probe_file)(flag, path)
