"""Loading checkpoint files without running code from them.

Every ``.pt`` file is read with ``torch.load(weights_only=True)``: tensors,
numbers, strings, lists, tuples and dicts only. ``torch.distributed.checkpoint``
stores its index (``.metadata``) with plain ``pickle``; :class:`SafeFileSystemReader`
reads it with an unpickler that admits only the checkpoint-metadata classes,
torch dtypes/sizes and paths. Anything else is refused with one line before any
object is built, so a file carrying a pickled callable never runs it.
"""
from __future__ import annotations

import os
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked; the message says what to do (one line)."""


def safe_torch_load(path: str, mmap: bool = False) -> Any:
    """``torch.load`` restricted to plain data; pickled code is refused with a CheckpointError.

    ``mmap`` maps the tensors instead of reading them: a converter touching one layer at a
    time then keeps only that layer's pages resident.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"refusing to load {path}: it holds pickled objects outside the plain-data "
                              f"allow-list ({first[:160]}); only load checkpoints you trust to be data") from None
    except (RuntimeError, EOFError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot read {path} ({first[:160]}): the file is truncated or not a torch file; "
                              f"load another iteration with --ckpt-step") from None


_ALLOWED = {  # exactly what torch.distributed.checkpoint's index is made of
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
    ("torch", "Size"), ("collections", "OrderedDict"),
    *(("pathlib", n) for n in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"))}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if "." not in name and ((module, name) in _ALLOWED or (
                module == "torch" and isinstance(getattr(torch, name, None),
                                                 (torch.dtype, torch.layout, torch.memory_format)))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint index")


class SafeFileSystemReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` index is unpickled with the allow-list above."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        rank = kwargs.get("rank")
        path = os.path.join(str(self.path), ".metadata" if rank is None else f"__{rank}.metadata")
        if not os.path.exists(path):
            raise CheckpointError(f"{path} is missing: the checkpoint is incomplete or not a sharded checkpoint")
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
            raise CheckpointError(f"refusing to load {path}: {e}; only load checkpoints you trust to be "
                                  f"data") from None
        if getattr(metadata, "storage_meta", None) is None and hasattr(dcp_metadata, "StorageMeta"):
            metadata.storage_meta = dcp_metadata.StorageMeta()
        if getattr(metadata, "storage_meta", None) is not None and hasattr(self, "load_id"):
            metadata.storage_meta.load_id = self.load_id
        return metadata
