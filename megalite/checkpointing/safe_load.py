"""Loading checkpoint files without running code from them.

Every ``.pt`` file is read with ``torch.load(weights_only=True)``: tensors,
numbers, strings, lists, tuples and dicts only. ``torch.distributed.checkpoint``
stores its index (``.metadata``) with plain ``pickle``; :class:`SafeFileSystemReader`
reads it with an unpickler that admits only the checkpoint-metadata classes,
torch dtypes/sizes and paths. Anything else is refused with one line before any
object is built, so a file carrying a pickled callable never runs it.
"""
from __future__ import annotations

import io
import pickle
import types
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_fs


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked; the message says what to do (one line)."""


def safe_torch_load(path: str) -> Any:
    """``torch.load`` restricted to plain data; pickled code is refused with a CheckpointError."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"refusing to load {path}: it holds pickled objects outside the plain-data "
                              f"allow-list ({first[:160]}); only load checkpoints you trust to be data") from None


_PATH_CLASSES = {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch.distributed.checkpoint."):
            obj = super().find_class(module, name)
            if isinstance(obj, type):  # dataclasses and enums of the metadata, no functions
                return obj
        elif module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None),
                                                                 (torch.dtype, torch.layout, torch.memory_format))):
            return getattr(torch, name)
        elif (module, name) == ("torch.serialization", "_get_layout"):
            return super().find_class(module, name)
        elif module == "pathlib" and name in _PATH_CLASSES:
            return super().find_class(module, name)
        elif (module, name) == ("collections", "OrderedDict"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint index")


def _restricted_load(f) -> Any:
    return _MetadataUnpickler(f).load()


class SafeFileSystemReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is unpickled with an allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        shim = types.SimpleNamespace(load=_restricted_load, loads=lambda b: _restricted_load(io.BytesIO(b)),
                                     UnpicklingError=pickle.UnpicklingError)
        original = dcp_fs.pickle
        dcp_fs.pickle = shim  # the stock reader calls pickle.load on the index
        try:
            return super().read_metadata(*args, **kwargs)
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"refusing to load {self.path}/.metadata: {e}; only load checkpoints "
                                  f"you trust to be data") from None
        finally:
            dcp_fs.pickle = original
