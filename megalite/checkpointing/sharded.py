"""The sharded format: layout-free blocks on torch.distributed.checkpoint.

::

    iter_0000100/
      __<rank>_0.distcp  .metadata   every tensor block once (torch.distributed.checkpoint's files)
      index_<rank>.json              what each stored tensor is (one entry per tensor, below)
      rng_<rank>.pt                  RandomStates of each rank (restored only into the same layout)

Model blocks are slices of each parameter's full tensor (``layout.py``); the
optimizer state (fp32 main weights ``optim.param``, Adam moments ``optim.exp_avg``,
``optim.exp_avg_sq``) is stored as the same blocks, so a checkpoint loads into any
tp, pp, vp, dp and distributed-optimizer setting: each rank reads the stored
tensors that overlap the blocks it holds. An index entry is::

    {"key": "<prefix>/<name>@<offsets>[#<lo>]", "prefix": "model" | "optim.<state>", "name": global tensor,
     "shape": its global shape, "offsets", "sizes": the block (a box of it), "dtype",
     "flat": [lo, hi]   (optional) the stored tensor is 1-D: elements [lo, hi) of the block's row-major
                        flattening -- what one DP rank owns under the distributed optimizer; the
                        entries of all DP ranks together cover the block once
     "crc32": int}      (optional) zlib.crc32 of the stored tensor's bytes, taken at save

Without ``"flat"`` the stored tensor is the whole block (``sizes``). The reader
(``sharded_read.py``) checks each entry against its key and against ``.metadata``
(a shifted offset or size is refused), checks that the entries tile every block it
needs, and verifies every entry's checksum as it reads it: ``"crc32"`` where the
index has one, else the CRC-32 torch's zip container keeps for the tensor's data.
A mismatch, and a missing, truncated or zeroed file, is one CheckpointError naming
the file. Tensors are read straight from the ``.distcp`` files (:class:`ItemFiles`)
into the run's tensors where the layout matches; nothing is unpickled but the
allow-listed ``.metadata`` (``safe_load.py``) and, for a stored item in a form the
direct path does not know, ``torch.load(weights_only=True)`` of that item.

This module holds what the writer (``sharded_write.py``) and reader share.
"""

from __future__ import annotations

import contextlib
import io
import os
import struct
import threading
import warnings
import zipfile
import zlib
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from megalite.checkpointing.protocol import read_json
from megalite.checkpointing.safe_load import CheckpointError

OPTIM_KEYS = ("param", "exp_avg", "exp_avg_sq")
AGAIN = "load another iteration with --ckpt-step"

__all__ = ["OPTIM_KEYS", "AGAIN", "quiet_single_process", "read_index", "entry_key", "ItemFiles", "crc_of"]


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """torch.distributed.checkpoint warns when it runs without a process group; that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        warnings.filterwarnings("ignore", message="Global metadata is not found")
        yield


def entry_key(e: dict) -> str:
    """The key an index entry's own fields give (a shifted offset no longer matches the stored key)."""
    key = f"{e['prefix']}/{e['name']}@{','.join(map(str, e['offsets']))}"
    return key + (f"#{e['flat'][0]}" if "flat" in e else "")


def _check_entry(e, path: str) -> None:
    ints = lambda v: isinstance(v, list) and all(type(x) is int and x >= 0 for x in v)  # noqa: E731
    ok = (
        isinstance(e, dict)
        and all(isinstance(e.get(k), str) for k in ("key", "prefix", "name", "dtype"))
        and ints(e.get("shape"))
        and ints(e.get("offsets"))
        and ints(e.get("sizes"))
        and len(e["shape"]) == len(e["offsets"]) == len(e["sizes"])
        and all(o + s <= n for o, s, n in zip(e["offsets"], e["sizes"], e["shape"]))
        and isinstance(getattr(torch, e["dtype"], None), torch.dtype)
        and (
            "flat" not in e
            or (ints(e["flat"]) and len(e["flat"]) == 2 and e["flat"][0] < e["flat"][1] <= _numel(e["sizes"]))
        )
        and ("crc32" not in e or type(e["crc32"]) is int)
    )
    if not ok:
        raise CheckpointError(f"{path} is damaged (entry {str(e)[:120]}); {AGAIN}")
    if e["key"] != entry_key(e):
        raise CheckpointError(
            f"{path}: entry {e['key']!r} does not match its offsets {e['offsets']}"
            f"{' and flat range ' + str(e['flat']) if 'flat' in e else ''}: the index is "
            f"damaged; {AGAIN}"
        )


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def read_index(d: str, world: Optional[int] = None) -> Dict[Tuple[str, str], List[dict]]:
    """Every rank's ``index_<rank>.json`` of ``d`` joined: (prefix, tensor name) -> its saved entries.

    ``world``: the number of ranks that saved it; a missing index file is one line naming it.
    """
    out: Dict[Tuple[str, str], List[dict]] = {}
    names = sorted(fn for fn in os.listdir(d) if fn.startswith("index_") and fn.endswith(".json"))
    for r in range(world or 0):
        if f"index_{r:05d}.json" not in names:
            raise CheckpointError(
                f"{os.path.join(d, f'index_{r:05d}.json')} is missing: the checkpoint is incomplete; {AGAIN}"
            )
    for fn in names:
        path = os.path.join(d, fn)
        entries = read_json(path)
        if not isinstance(entries, list):
            raise CheckpointError(f"{path} is damaged (not a list of entries); {AGAIN}")
        for e in entries:
            _check_entry(e, path)
            out.setdefault((e["prefix"], e["name"]), []).append(e)
    return out


_HEADER = struct.Struct("<IHHHHHIIIHH")  # a zip local file header
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # a zip central directory record


class _Slice(io.RawIOBase):
    """Bytes [start, start + length) of an open file, as a file of their own (one stored item)."""

    def __init__(self, f: io.FileIO, start: int, length: int) -> None:
        super().__init__()
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = max(0, min(self.length, pos + (0, self.pos, self.length)[whence]))
        return self.pos

    def readinto(self, b) -> int:
        n = _pread_into(self.f, memoryview(b).cast("B")[: max(0, self.length - self.pos)], self.start + self.pos)
        self.pos += n
        return n


_LOCK = threading.Lock()


def _pread_into(f: io.FileIO, mv: memoryview, offset: int) -> int:
    """One positional read into ``mv`` (``os.preadv``; a locked seek and read where it is missing)."""
    if not len(mv):
        return 0
    if hasattr(os, "preadv"):
        return os.preadv(f.fileno(), [mv], offset)
    with _LOCK:
        f.seek(offset)
        return f.readinto(mv) or 0


class ItemFiles:
    """The stored tensors of one sharded checkpoint, read from the ``.distcp`` files directly.

    DCP stores each tensor as a ``torch.save`` zip at (file, offset, length) (``.metadata``'s
    storage info); its data record ``*/data/0`` holds the tensor's bytes uncompressed, so
    :meth:`locate` finds them by the zip headers alone and readers copy them into place
    with ``readinto``. An item in another form falls back to ``torch.load(weights_only=True)``.
    """

    def __init__(self, d: str, metadata) -> None:
        self.d, self.meta = d, metadata.state_dict_metadata
        self.where = {idx.fqn: info for idx, info in metadata.storage_data.items()}
        self.files: Dict[str, io.FileIO] = {}
        self._opening = threading.Lock()  # reader threads open files through _file

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()

    def damaged(self, path: str, what: str) -> CheckpointError:
        return CheckpointError(f"{path}: {what}; the checkpoint is damaged: {AGAIN}")

    def _file(self, rel: str) -> Tuple[str, io.FileIO]:
        path = os.path.join(self.d, rel)
        with self._opening:
            if path not in self.files:
                try:
                    self.files[path] = io.FileIO(path, "rb")
                except OSError as e:
                    raise CheckpointError(
                        f"{path} is missing or unreadable ({e.strerror}): the checkpoint is incomplete; {AGAIN}"
                    ) from None
            return path, self.files[path]

    def read(self, f: io.FileIO, path: str, offset: int, buf) -> None:
        """Exactly ``len(buf)`` bytes at ``offset`` into ``buf`` (a writable buffer); safe across threads."""
        mv, got = memoryview(buf).cast("B"), 0
        try:
            while got < len(mv):
                n = _pread_into(f, mv[got:], offset + got)
                if not n:
                    raise self.damaged(path, f"truncated (no bytes at {offset + got})")
                got += n
        except OSError as e:
            raise self.damaged(path, f"unreadable ({e.strerror})") from None

    def _pread(self, f, path: str, offset: int, n: int) -> bytes:
        buf = bytearray(n)
        self.read(f, path, offset, buf)
        return bytes(buf)

    def check(self, e: dict, shape: List[int]) -> None:
        """``.metadata`` stores the entry's key with the shape and dtype the index gives it."""
        md = self.meta.get(e["key"])
        if md is None or e["key"] not in self.where:
            raise CheckpointError(
                f"{os.path.join(self.d, '.metadata')} has no item {e['key']!r} that the index "
                f"names: the checkpoint is damaged; {AGAIN}"
            )
        props = getattr(md, "properties", None)
        if list(getattr(md, "size", ())) != shape or getattr(props, "dtype", None) != getattr(torch, e["dtype"]):
            raise CheckpointError(
                f"{self.d}: the index gives {e['key']!r} shape {shape} {e['dtype']}, .metadata "
                f"{list(getattr(md, 'size', ()))} {getattr(props, 'dtype', None)}: the index is "
                f"damaged; {AGAIN}"
            )

    def locate(self, key: str, nbytes: int) -> Optional[Tuple[io.FileIO, str, int, int]]:
        """(file, path, byte offset, zip CRC-32) of ``key``'s ``nbytes`` data bytes; None: use :meth:`load`."""
        info = self.where[key]
        if getattr(info, "transform_descriptors", None):
            return None
        path, f = self._file(info.relative_path)
        # DCP streams each item: sizes and CRC are in the zip's central directory, not the local headers
        rec = self._directory(f, path, info) or self._zipfile(f, path, info, key)
        if rec is None:
            return None
        method, crc, csize, usize, at = rec
        if method != 0:
            return None
        head = self._pread(f, path, info.offset + at, _HEADER.size)
        sig, *_, nlen, xlen = _HEADER.unpack(head)
        start = at + _HEADER.size + nlen + xlen
        if sig != 0x04034B50 or usize != nbytes or csize != nbytes or start + nbytes > info.length:
            raise self.damaged(path, f"item {key!r} holds {usize} bytes, the index {nbytes}")
        return f, path, info.offset + start, crc

    def _directory(self, f, path: str, info) -> Optional[tuple]:
        """The ``*/data/0`` record (method, crc, sizes, header offset) from the zip's end, without zipfile;
        None when the item needs zipfile (zip64, a comment, more than one tensor, no directory where expected)."""
        n = min(info.length, 2048)
        tail = self._pread(f, path, info.offset + info.length - n, n)
        i = tail.rfind(b"PK\x05\x06")
        if i < 0 or len(tail) - i != 22:
            return None
        _, _, _, _, count, size, cd = struct.unpack_from("<IHHHHII", tail, i)
        base = info.length - n
        if cd < base or cd + size > base + i or 0xFFFF == count:
            return None
        found, pos = [], cd - base
        for _ in range(count):
            if tail[pos : pos + 4] != b"PK\x01\x02":
                return None
            (_, _, _, _, method, _, _, crc, csize, usize, nlen, xlen, clen, _, _, _, at) = _CENTRAL.unpack_from(
                tail, pos
            )
            name = tail[pos + _CENTRAL.size : pos + _CENTRAL.size + nlen]
            if b"/data/" in name:
                found.append((name, (method, crc, csize, usize, at)))
            pos += _CENTRAL.size + nlen + xlen + clen
        if len(found) != 1 or not found[0][0].endswith(b"/data/0") or 0xFFFFFFFF in found[0][1][2:]:
            return None
        return found[0][1]

    def _zipfile(self, f, path: str, info, key: str) -> Optional[tuple]:
        try:
            with zipfile.ZipFile(_Slice(f, info.offset, info.length)) as z:
                data = [r for r in z.infolist() if "/data/" in r.filename]
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
            raise self.damaged(
                path, f"no stored tensor at bytes {info.offset}..{info.offset + info.length} (item {key!r}: {e})"
            ) from None
        if len(data) != 1 or not data[0].filename.endswith("/data/0"):
            return None
        r = data[0]
        return r.compress_type, r.CRC, r.compress_size, r.file_size, r.header_offset

    def load(self, key: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The whole stored tensor through ``torch.load(weights_only=True)`` (1-D)."""
        info = self.where[key]
        path, f = self._file(info.relative_path)
        blob = self._pread(f, path, info.offset, info.length)
        if getattr(info, "transform_descriptors", None):
            raise self.damaged(
                path,
                f"item {key!r} is stored with transforms {info.transform_descriptors}, "
                f"which this reader does not apply",
            )
        try:
            t = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any failure means the item is damaged
            raise self.damaged(path, f"item {key!r} cannot be read ({type(e).__name__})") from None
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.numel() != numel:
            raise self.damaged(path, f"item {key!r} is not the {numel}-element {dtype} tensor the index names")
        return t.contiguous().view(-1)


def crc_of(t: torch.Tensor, crc: int = 0) -> int:
    """``zlib.crc32`` of a contiguous CPU tensor's bytes, continuing from ``crc``."""
    return zlib.crc32(t.view(-1).view(torch.uint8).numpy(), crc) if t.numel() else crc
