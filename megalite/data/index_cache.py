"""The on-disk cache of dataset index arrays (.npy), written atomically and checked on load.

Each cached set is ``{md5}-{name}.npy`` per array plus ``{md5}-description.json``,
where md5 hashes the description (every input that defines the arrays). The
description is written last, so its presence means the set is complete.

A cache hit is trusted only after a check against what the caller knows the
arrays must be (dtype and shape follow from the inputs before anything is
built): a truncated, unreadable or foreign file would otherwise train on
wrong samples without a word. A bad file is a one-line :class:`IndexCacheError`
naming the file and what to do, never a numpy traceback.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Callable, Optional

import numpy as np

logger = logging.getLogger(__name__)

# name -> (dtype the array must have, shape it must have)
ArraySpec = dict[str, tuple[np.dtype, tuple[int, ...]]]


class IndexCacheError(ValueError):
    """A cached index file exists but cannot be used; the message names it and the fix."""


def _damaged(path: str, problem: str) -> IndexCacheError:
    return IndexCacheError(
        f"{path}: damaged dataset index cache ({problem}); delete it "
        f"(or its directory {os.path.dirname(path)}) and rerun: it is "
        "rebuilt from the data"
    )


def load_checked(path: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Memory-map one cached array, refusing it unless it has exactly ``dtype`` and ``shape``."""
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as e:  # noqa: BLE001 - any failure to read it means the same to the user
        raise _damaged(path, f"unreadable: {type(e).__name__}: {e}") from None
    if not isinstance(arr, np.ndarray):
        raise _damaged(path, "not a single array")
    if arr.dtype != np.dtype(dtype):
        raise _damaged(path, f"dtype {arr.dtype}, expected {np.dtype(dtype)}")
    if tuple(arr.shape) != tuple(shape):
        raise _damaged(path, f"shape {tuple(arr.shape)}, expected {tuple(shape)}")
    return arr


def _load_set(paths: dict, marker: str, text: str, spec: ArraySpec) -> dict:
    try:
        with open(marker, encoding="utf-8") as f:
            stored = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise _damaged(marker, f"unreadable: {e}") from None
    if stored != text:
        raise _damaged(marker, "description does not match its name")
    return {n: load_checked(p, *spec[n]) for n, p in paths.items()}


def _save_set(arrays: dict, paths: dict, marker: str, text: str, cache_dir: str) -> None:
    try:
        os.makedirs(cache_dir, exist_ok=True)
        for n, p in paths.items():
            tmp = f"{p}.tmp-{os.getpid()}.npy"
            np.save(tmp, arrays[n], allow_pickle=False)
            os.replace(tmp, p)
        tmp = f"{marker}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, marker)
    except OSError as e:
        logger.warning("could not write index cache under %s (%s); using in-memory indices", cache_dir, e)


def cached_arrays(
    cache_dir: Optional[str], description: dict, spec: ArraySpec, build: Callable[[], dict], write: bool
) -> tuple[dict, bool]:
    """Load the arrays of ``spec`` from the cache keyed by ``description``, or build them.

    Returns (arrays, cache_hit). With ``write`` (the primary rank), a miss is
    built and saved (temporary names, then renames, the description last).
    Without ``write``, a miss is built in memory with a warning (the cache is
    not shared between these ranks). A hit whose files do not match ``spec``
    raises :class:`IndexCacheError`. Freshly built arrays are checked against
    ``spec`` too, so a wrong expectation fails at once rather than at the
    next run's load.
    """
    text = json.dumps(description, sort_keys=True, indent=2)
    key = hashlib.md5(text.encode()).hexdigest()
    paths: dict = {}
    marker = ""
    if cache_dir is not None:
        paths = {n: os.path.join(cache_dir, f"{key}-{n}.npy") for n in spec}
        marker = os.path.join(cache_dir, f"{key}-description.json")
        if os.path.isfile(marker) and all(os.path.isfile(p) for p in paths.values()):
            return _load_set(paths, marker, text, spec), True
    t0 = time.time()
    arrays = build()
    for n, (dtype, shape) in spec.items():
        a = arrays[n]
        if a.dtype != np.dtype(dtype) or tuple(a.shape) != tuple(shape):
            raise AssertionError(f"built {n} is {a.dtype}{a.shape}, expected {dtype}{shape}")
    logger.info("built %s indices in %.2fs", description.get("class"), time.time() - t0)
    if cache_dir is None:
        return arrays, False
    if not write:
        logger.warning(
            "index cache %s missing on a non-primary rank (is --data-cache-path shared?); built in memory", cache_dir
        )
        return arrays, False
    _save_set(arrays, paths, marker, text, cache_dir)
    return arrays, False
