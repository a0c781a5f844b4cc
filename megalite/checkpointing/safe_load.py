"""Loading checkpoint files without running code from them.

Every ``.pt`` file is read with ``torch.load(weights_only=True)``: tensors,
numbers, strings, lists, tuples and dicts only. Megatron-LM's files also hold
a few plain-data types (:func:`load_megatron_file`): argparse's Namespace, the
``signal.Signals`` enum, numpy arrays and dtypes (its RNG state), and Megatron's
own enums, which load as inert :class:`MegatronValue` stand-ins (megatron is never
imported). Nothing on that list can run code; every other global in such a file is
refused, by its full name, before anything is unpickled. ``torch.distributed.checkpoint``
stores its index (``.metadata``) with plain ``pickle``; :class:`SafeFileSystemReader`
reads it with an unpickler that admits only the checkpoint-metadata classes,
torch dtypes/sizes and paths. Anything else is refused with one line before any
object is built, so a file carrying a pickled callable never runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import pickletools
import re
import signal
import zipfile
from typing import Any, Dict, Iterator, List

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked; the message says what to do (one line).

    ``report`` is False on the ranks that only follow another rank's failure (that rank says why).
    """

    def __init__(self, message: str = "", report: bool = True):
        super().__init__(message)
        self.report = report


def safe_torch_load(path: str, mmap: bool = False) -> Any:
    """``torch.load`` restricted to plain data; pickled code is refused with a CheckpointError.

    ``mmap`` maps the tensors instead of reading them: a converter touching one layer at a
    time then keeps only that layer's pages resident.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"refusing to load {path}: it holds {_refused_name(e, path)}, outside the "
            f"plain-data allow-list; only load checkpoints you trust to be data"
        ) from None
    except (RuntimeError, EOFError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"cannot read {path} ({first[:160]}): the file is truncated or not a torch file; "
            f"load another iteration with --ckpt-step"
        ) from None


def _refused_name(e: Exception, path: str) -> str:
    """The full name of what torch's weights-only unpickler refused, from its (multi-line) message."""
    text = str(e)
    for pattern in (r"GLOBAL ([\w.]+)", r"got <class '([^']+)'>", r"function <class '([^']+)'>", r"function ([\w.]+)"):
        m = re.search(pattern, text)
        if m:
            name = m.group(1)
            if "." not in name:  # torch drops "builtins.": the file's own list of globals has the full name
                try:
                    name = next((n for n in _globals_in(path) if n.endswith("." + name)), name)
                except Exception:  # noqa: BLE001 - the short name is still the answer
                    pass
            return f"the pickled object {name}"
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    return f"pickled objects it may not build ({first})"


# -- Megatron-LM's files ------------------------------------------------------------------------------
class MegatronValue:
    """An inert stand-in for a value of one of Megatron's own classes (its enums: AttnBackend, ModelType..).

    Holds the class's full name and what the file passed to it; runs nothing and imports nothing.
    """

    megatron_class = "megatron"

    def __init__(self, *args: Any) -> None:
        self.args = args
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.megatron_class}{self.args!r}>"


def _stand_in(full_name: str) -> type:
    """A MegatronValue subclass that torch's unpickler files under ``full_name`` (module + qualified name)."""
    module, _, name = full_name.rpartition(".")
    return type(name, (MegatronValue,), {"__module__": module, "__qualname__": name, "megatron_class": full_name})


def _np_function(name: str):
    """numpy's array/scalar rebuilders, from numpy 2's ``numpy._core`` or numpy 1's ``numpy.core``."""
    try:
        from numpy._core import multiarray  # numpy >= 2
    except ImportError:  # numpy 1.x
        from numpy.core import multiarray
    return getattr(multiarray, name)


def _numpy_globals() -> Dict[str, Any]:
    """numpy's plain-data pieces by the names files give them (written by numpy 1 or 2, read by either)."""
    out: Dict[str, Any] = {"numpy.ndarray": np.ndarray, "numpy.dtype": np.dtype}
    for fn in ("_reconstruct", "scalar"):
        real = _np_function(fn)
        for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
            # a same-named wrapper: torch files an allowed global under its __module__.__qualname__
            def wrapper(*args, _real=real):
                return _real(*args)

            wrapper.__module__, wrapper.__qualname__, wrapper.__name__ = module, fn, fn
            out[f"{module}.{fn}"] = wrapper
    dtype_classes = {type(np.dtype(c)) for c in np.typecodes["All"]}  # BUILD on a dtype checks its class
    dtypes = getattr(np, "dtypes", None)  # numpy >= 1.25 names them numpy.dtypes.UInt32DType..
    if dtypes is not None:
        dtype_classes |= {v for v in vars(dtypes).values() if isinstance(v, type) and issubclass(v, np.dtype)}
    for cls in dtype_classes:
        out[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return out


# torch >= 2.6 admits (object, "module.name") pairs: needed for globals that are values, not classes
_NAMED_GLOBALS = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) >= (2, 6)


def _megatron_allowed(names: List[str], path: str) -> List[Any]:
    """What each global named in a Megatron file loads as; a CheckpointError names the first one refused.

    Megatron-LM (core_v0.16.1) pickles, besides tensors: ``args`` (argparse.Namespace) holding
    ``exit_signal`` (signal.Signals), ``attention_backend`` (AttnBackend), ``model_type`` (ModelType),
    torch dtypes; ``rng_state`` with ``np.random.get_state()`` (a uint32 ndarray, its dtype class).
    """
    table = {"argparse.Namespace": argparse.Namespace, "signal.Signals": signal.Signals, **_numpy_globals()}
    if _NAMED_GLOBALS:  # Python <= 3.10 pickles a signal as its global name (signal.SIGTERM), not Signals(15)
        table.update({f"signal.{m.name}": (m, f"signal.{m.name}") for m in signal.Signals})
    allowed = []
    for n in names:
        if n in table:
            allowed.append(table[n])
        elif n.startswith("megatron.") and re.fullmatch(r"[A-Za-z_][\w.]*", n):
            allowed.append(_stand_in(n))
        else:
            raise CheckpointError(
                f"refusing to load {path}: it holds the pickled object {n}, outside the "
                f"plain-data allow-list for Megatron checkpoints; only load checkpoints you trust"
            )
    # numpy dtypes are rebuilt then given their state: their classes must be known even when not named
    return allowed + [v for k, v in table.items() if k.startswith("numpy.") and v not in allowed]


def _globals_in(path: str) -> List[str]:
    """Every global a torch zip file's pickle names, outside the ones torch's unpickler always allows."""
    if hasattr(torch.serialization, "get_unsafe_globals_in_checkpoint"):  # torch >= 2.5
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    with zipfile.ZipFile(path) as z:  # older torch: read the GLOBAL opcodes ourselves
        pkl = next(n for n in z.namelist() if n.endswith("/data.pkl"))
        names = []
        for op, arg, _ in pickletools.genops(z.read(pkl)):
            if op.name in ("STACK_GLOBAL", "INST", "OBJ"):  # names not spelled out: nothing can be vouched for
                raise pickle.UnpicklingError(f"opcode {op.name}")
            if op.name == "GLOBAL":
                name = arg.replace(" ", ".")
                if not name.startswith(("torch.", "collections.OrderedDict", "_codecs.encode")):
                    names.append(name)
        return names


@contextlib.contextmanager
def _allowing(objs: List[Any]) -> Iterator[None]:
    """Admit ``objs`` to torch's weights-only unpickler for one load, leaving others' registrations as found."""
    ser = torch.serialization
    present = ser.get_safe_globals() if hasattr(ser, "get_safe_globals") else []
    new = [o for o in dict.fromkeys(objs) if o not in present]
    if hasattr(ser, "safe_globals"):  # torch >= 2.5: removes exactly what it added on exit
        with ser.safe_globals(new):
            yield
        return
    ser.add_safe_globals(new)  # torch 2.4: add, then put the registry back as it was
    try:
        yield
    finally:
        ser.clear_safe_globals()
        ser.add_safe_globals(list(present))


def load_megatron_file(path: str) -> dict:
    """One Megatron-LM ``.pt`` file (memory-mapped), unpickled only as far as the allow-list above permits."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete")
    try:
        names = _globals_in(path)
    except pickle.UnpicklingError as e:  # opcodes the inspector does not know
        raise CheckpointError(
            f"refusing to load {path}: its pickle cannot be checked against the allow-list "
            f"({str(e).strip().splitlines()[0] if str(e).strip() else 'unknown opcode'})"
        ) from None
    except Exception as e:  # noqa: BLE001 - any failure means the file is not a torch zip file
        raise CheckpointError(f"cannot read {path} ({type(e).__name__}): not a torch checkpoint file") from None
    with _allowing(_megatron_allowed(names, path)):
        return safe_torch_load(path, mmap=True)


_ALLOWED = {  # exactly what torch.distributed.checkpoint's index is made of
    ("torch.distributed.checkpoint.metadata", n)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    # megatron-core's torch_dist index also keeps every rank's save plan (plain dataclasses and an enum)
    *(
        ("torch.distributed.checkpoint.planner", n)
        for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")
    ),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    *(("pathlib", n) for n in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
}


class _NotAllowed(pickle.UnpicklingError):
    """The index names code outside the allow-list: a matter of trust, not of damage."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if "." not in name and (
            (module, name) in _ALLOWED
            or (
                module == "torch"
                and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))
            )
        ):
            return super().find_class(module, name)
        raise _NotAllowed(f"{module}.{name} is not allowed in a checkpoint index")


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
        except _NotAllowed as e:
            raise CheckpointError(f"refusing to load {path}: {e}; only load checkpoints you trust to be data") from None
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError, KeyError) as e:
            # a cut-off copy or a disk error, not tampering: the index cannot be read at all
            raise CheckpointError(
                f"{path} is damaged or truncated ({os.path.getsize(path)} bytes; {str(e) or type(e).__name__}): "
                f"the checkpoint's index cannot be read; copy the checkpoint again, or load another "
                f"iteration with --ckpt-step"
            ) from None
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise CheckpointError(
                f"{path} is damaged: it holds a {type(metadata).__name__}, not a checkpoint index; copy the "
                f"checkpoint again, or load another iteration with --ckpt-step"
            )
        if getattr(metadata, "storage_meta", None) is None and hasattr(dcp_metadata, "StorageMeta"):
            metadata.storage_meta = dcp_metadata.StorageMeta()
        if getattr(metadata, "storage_meta", None) is not None and hasattr(self, "load_id"):
            metadata.storage_meta.load_id = self.load_id
        return metadata
