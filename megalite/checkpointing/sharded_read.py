"""The sharded format's reader (the format is described in ``sharded.py``).

A rank first plans: for each block its parameters hold (``layout.py``) and each state it
loads, the destinations (the parameter itself; the optimizer's fp32 main weight and new Adam
moments for the elements this rank's optimizer owns, ``MegatronOptimizer.load_targets``) and
the stored boxes that overlap them. A stored box that is a contiguous run of the block (the
same layout: a whole block, or a distributed optimizer's flat piece) goes straight into place
with ``readinto``; across layouts each box's overlap is copied into a view of the destination,
or, where the destination is a flat shard that splits the block's rows, into the rows it
needs (every element overwritten, nothing zero-filled), then into the shard. Then each stored
tensor is read once, in file order, and its checksum verified (``sharded.py``).
"""

from __future__ import annotations

import contextlib
import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from megalite.checkpointing.layout import Block, chunk_blocks, flat_boxes, overlap
from megalite.checkpointing.protocol import agree_on_error
from megalite.checkpointing.safe_load import CheckpointError, SafeFileSystemReader, safe_torch_load
from megalite.checkpointing.sharded import AGAIN, OPTIM_KEYS, ItemFiles, crc_of, read_index
from megalite.parallel.state import ParallelState

__all__ = ["read_sharded", "read_whole", "Reads"]

PREFIXES = ("model",) + tuple(f"optim.{k}" for k in OPTIM_KEYS)  # the order reads land in: main weights win
Dest = Tuple[int, int, torch.Tensor]  # elements [start, end) of a local tensor's flattening -> a 1-D tensor


def _run_in(b: Block, offsets, sizes) -> Optional[int]:
    """Where box (offsets, sizes) starts in block ``b``'s flattening when it is a contiguous run of it."""
    if any(o < bo or o + s > bo + bs for o, s, bo, bs in zip(offsets, sizes, b.offsets, b.sizes)):
        return None
    j = next((i for i, s in enumerate(sizes) if s != 1), len(sizes))
    if any(s != bs for s, bs in zip(sizes[j + 1 :], b.sizes[j + 1 :])):
        return None
    start, stride = 0, 1
    for o, bo, bs in zip(reversed(offsets), reversed(b.offsets), reversed(b.sizes)):
        start, stride = start + (o - bo) * stride, stride * bs
    return start


class Reads:
    """The reads one rank does from checkpoint ``d``: planned by :meth:`plan`, done by :meth:`run`."""

    def __init__(self, d: str, index: Dict[Tuple[str, str], List[dict]], files: ItemFiles):
        self.d, self.index, self.files = d, index, files
        self.uses: Dict[str, Dict[str, list]] = {p: {} for p in PREFIXES}  # prefix -> key -> uses
        self.staged: Dict[str, list] = {p: [] for p in PREFIXES}  # (assembled rows, destination) copies
        self.entries: Dict[str, dict] = {}
        self.covered: set = set()

    def _boxes(self, prefix: str, b: Block) -> list:
        entries = self.index.get((prefix, b.name))
        if not entries:
            raise CheckpointError(
                f"{self.d} has no {prefix} tensor {b.name!r}: it was saved from another model; check the model flags"
            )
        out = []
        for e in entries:
            if e["shape"] != list(b.global_shape):
                raise CheckpointError(
                    f"{self.d}: {b.name} has shape {e['shape']} in the checkpoint, "
                    f"{list(b.global_shape)} in this run; check the model flags"
                )
            flat = e.get("flat")
            boxes = (
                flat_boxes(e["offsets"], e["sizes"], *flat) if flat else [(tuple(e["offsets"]), tuple(e["sizes"]), 0)]
            )
            out += [(e, o, s, place) for o, s, place in boxes if overlap(b.offsets, b.sizes, o, s)]
        if (prefix, b.key) not in self.covered:  # the entries must tile the block: none missing, none twice
            self.covered.add((prefix, b.key))
            have = sum(math.prod(x.stop - x.start for x in overlap(b.offsets, b.sizes, o, s)[0]) for _, o, s, _ in out)
            if have != math.prod(b.sizes):
                raise CheckpointError(
                    f"{self.d}: the entries of {prefix} tensor {b.name!r} cover {have} of the "
                    f"{math.prod(b.sizes)} elements of its block at {list(b.offsets)}: an index "
                    f"is damaged or missing; {AGAIN}"
                )
        return out

    def _use(self, prefix: str, e: dict, use: tuple) -> None:
        if e["key"] not in self.entries:
            self.files.check(e, [e["flat"][1] - e["flat"][0]] if "flat" in e else e["sizes"])
            self.entries[e["key"]] = e
        self.uses[prefix].setdefault(e["key"], []).append(use)

    def plan(self, prefix: str, blocks: Sequence[Block], row: int, dests: Sequence[Dest]) -> None:
        """Read ``prefix``'s stored boxes of ``blocks`` (local rows of ``row`` elements) into ``dests``."""
        for b in blocks:
            boxes = self._boxes(prefix, b)
            n, a0 = math.prod(b.sizes), b.local_rows[0] * row
            runs = [_run_in(b, o, s) for _, o, s, _ in boxes]
            for s, e, t in dests:
                u, v = max(s, a0) - a0, min(e, a0 + n) - a0
                if u >= v:
                    continue
                if None not in runs:  # every box is a run of the block: bytes straight into place
                    for (ent, _, bs, place), start in zip(boxes, runs):
                        x, y = max(u, start), min(v, start + math.prod(bs))
                        if x < y:
                            self._use(
                                prefix, ent, ("flat", place + x - start, place + y - start, t[a0 + x - s : a0 + y - s])
                            )
                    continue
                rs = math.prod(b.sizes[1:])
                r0, r1 = u // rs, -(-v // rs)
                whole = (u, v) == (0, n)  # the destination holds the block: copy into a view of it
                rows = (
                    t[a0 - s : a0 + n - s].view(b.sizes)
                    if whole
                    else torch.empty((r1 - r0,) + tuple(b.sizes[1:]), dtype=t.dtype)
                )
                at = (b.offsets[0] + r0,) + tuple(b.offsets[1:])
                for ent, o, bs, place in boxes:
                    ov = overlap(at, rows.shape, o, bs)
                    if ov:
                        self._use(prefix, ent, ("box", place, bs, ov[1], rows[ov[0]]))
                if not whole:
                    self.staged[prefix].append((rows.view(-1)[u - r0 * rs : v - r0 * rs], t[a0 + u - s : a0 + v - s]))

    def run(self) -> None:
        """Every planned read, each stored tensor once, checksums verified; model first, main weights last."""
        workers = min(8, os.cpu_count() or 1)  # reads, checksums and copies release the GIL
        with ThreadPoolExecutor(workers) if workers > 1 else contextlib.nullcontext() as pool:
            for prefix in PREFIXES:  # one prefix after the other: a main weight may alias its parameter
                keys = sorted(
                    self.uses[prefix], key=lambda k: (self.files.where[k].relative_path, self.files.where[k].offset)
                )
                jobs = [(self.entries[k], self.uses[prefix][k]) for k in keys]
                if pool is None:
                    for job in jobs:
                        self._read(*job)
                else:  # destinations within a prefix are disjoint
                    for fut in [pool.submit(self._read, *job) for job in jobs]:
                        fut.result()
                for rows, dst in self.staged[prefix]:
                    dst.copy_(rows)

    def _read(self, e: dict, uses: list) -> None:
        dtype = getattr(torch, e["dtype"])
        n = e["flat"][1] - e["flat"][0] if "flat" in e else math.prod(e["sizes"])
        size = torch.empty((), dtype=dtype).element_size()
        loc = self.files.locate(e["key"], n * size)
        want = e.get("crc32", loc[3] or None if loc else None)  # else the zip record's CRC-32 (0: none kept)
        path = loc[1] if loc else os.path.join(self.d, self.files.where[e["key"]].relative_path)
        flats = sorted((u for u in uses if u[0] == "flat"), key=lambda u: u[1])
        direct = (
            loc is not None
            and len(flats) == len(uses)
            and all(t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() for _, _, _, t in flats)
            and all(flats[i][2] <= flats[i + 1][1] for i in range(len(flats) - 1))
        )
        if direct:
            f, _, off, _ = loc
            crc, pos = 0, 0
            for _, a, b, t in flats + [("flat", n, n, None)]:
                if want is not None and a > pos:  # bytes this rank does not need, read for the checksum
                    gap = torch.empty(a - pos, dtype=dtype)
                    self.files.read(f, path, off + pos * size, gap.view(torch.uint8).numpy())
                    crc = crc_of(gap, crc)
                if t is not None and b > a:
                    self.files.read(f, path, off + a * size, t.view(torch.uint8).numpy())
                    crc = crc_of(t, crc) if want is not None else crc
                pos = max(pos, b)
        else:
            if loc is not None:
                whole = torch.empty(n, dtype=dtype)
                self.files.read(loc[0], path, loc[2], whole.view(torch.uint8).numpy())
            else:
                whole = self.files.load(e["key"], dtype, n)
            crc = crc_of(whole) if want is not None else None
            for u in uses:
                if u[0] == "flat":
                    u[3].copy_(whole[u[1] : u[2]])
                else:
                    _, place, bs, sl, dst = u
                    dst.copy_(whole[place : place + math.prod(bs)].view(bs)[sl])
        if want is not None and crc != want:
            raise CheckpointError(
                f"{path}: {e['key']!r} fails its checksum (crc32 {crc:08x}, saved {want:08x}): "
                f"the checkpoint is damaged; {AGAIN}"
            )


def _zero_uncovered(blocks: Sequence[Block], row: int, dests: Sequence[Dest]) -> None:
    """Elements no block covers (vocabulary padding) are zero, as a fresh load leaves them."""
    spans = sorted((b.local_rows[0] * row, b.local_rows[0] * row + math.prod(b.sizes)) for b in blocks)
    for s, e, t in dests:
        pos = s
        for a, z in spans + [(e, e)]:
            if a > pos and pos < e:
                t[pos - s : min(a, e) - s].zero_()
            pos = max(pos, z)


def _plan_all(reads: Reads, chunks, optimizer, keys: List[str], main_from_model: bool):
    """Plan every parameter's reads; returns the optimizer's targets (see ``load_targets``)."""
    params = {(i, n): p for i, c in enumerate(chunks) for n, p in c.named_parameters()}
    where = {id(p): k for k, p in params.items()}
    dests: Dict[Tuple[int, str], Dict[str, List[Dest]]] = {
        k: {"model": optimizer.model_destinations(p)} for k, p in params.items()
    }
    targets = optimizer.load_targets(keys + (["param"] if main_from_model else [])) if keys or main_from_model else []
    for pc, tensors in targets:
        for k, t in tensors.items():
            prefix = "model" if k == "param" and main_from_model else f"optim.{k}"
            dests[where[id(pc.param)]].setdefault(prefix, []).append((pc.start, pc.end, t))
    for (i, name), blocks in chunk_blocks(chunks, for_write=False).items():
        row = blocks[0].row if blocks else 1  # no blocks (no real vocabulary rows here): all zero
        for prefix in PREFIXES:
            if prefix in dests[(i, name)]:
                reads.plan(prefix, blocks, row, dests[(i, name)][prefix])
                _zero_uncovered(blocks, row, dests[(i, name)][prefix])
    return targets


def read_sharded(
    d: str, meta: dict, ps: ParallelState, chunks: Sequence[nn.Module], optimizer, load_optim: bool, same_layout: bool
) -> Optional[dict]:
    """Load ``d``'s blocks into ``chunks`` and (with ``load_optim``) ``optimizer`` (collective).

    Returns this rank's saved random states when ``same_layout`` (the layout it was saved
    in), else None. The optimizer's step counts and scaler are the caller's (``meta.json``).
    """
    error, rng, targets = None, None, []
    files = None
    try:
        try:
            metadata = SafeFileSystemReader(d).read_metadata()  # allow-listed: refuses a tampered index
            layout = meta.get("layout") if isinstance(meta.get("layout"), dict) else {}
            # a run writes one index per rank; a converted checkpoint (tools/checkpoint/convert.py) one in all
            world = None if "converted_from" in layout else layout.get("world")
            index = read_index(d, world if isinstance(world, int) else None)
            files = ItemFiles(d, metadata)
            saved = [k for k in OPTIM_KEYS if any(pre == f"optim.{k}" for pre, _ in index)] if load_optim else []
            reads = Reads(d, index, files)
            # no fp32 main weights saved (fp32 run, or optimizer not loaded): a half run's are the weights
            targets = _plan_all(reads, chunks, optimizer, saved, optimizer.half and "param" not in saved)
            with torch.no_grad():
                reads.run()
            if same_layout:
                path = os.path.join(d, f"rng_{ps.rank:05d}.pt")
                if not os.path.exists(path):
                    raise CheckpointError(
                        f"{path} is missing: the checkpoint is incomplete; pass --no-load-rng "
                        f"to load it without random states"
                    )
                rng = safe_torch_load(path)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - a damaged file in a form not foreseen: still one line
            raise CheckpointError(
                f"reading {d} failed ({type(e).__name__}: {str(e)[:200]}); the checkpoint is damaged: {AGAIN}"
            ) from None
        finally:
            if files is not None:
                files.close()
    except CheckpointError as e:
        error = e
    agree_on_error(ps, error)  # a rank that cannot read must not leave the others in a collective
    if targets:
        optimizer.install_loaded(targets, meta.get("adam_step", 0.0))  # collective over DP (distributed optimizer)
    return rng


def read_whole(
    d: str, index: Dict[Tuple[str, str], List[dict]], names: Sequence[str], prefix: str = "model"
) -> Dict[str, torch.Tensor]:
    """Whole global tensors ``names`` of ``prefix`` from ``d`` (any writer's entries, flat or not; checked)."""
    out: Dict[str, torch.Tensor] = {}
    files = ItemFiles(d, SafeFileSystemReader(d).read_metadata())
    try:
        reads = Reads(d, index, files)
        for n in names:
            entries = index.get((prefix, n))
            if not entries:
                raise CheckpointError(
                    f"{d} has no {prefix} tensor {n!r}: it does not hold the model meta.json describes"
                )
            shape = tuple(entries[0]["shape"])
            out[n] = torch.empty(shape, dtype=getattr(torch, entries[0]["dtype"]))
            whole = Block(n, shape, (0,) * len(shape), (0, shape[0]), shape)
            reads.plan(prefix, [whole], math.prod(shape[1:]), [(0, out[n].numel(), out[n].view(-1))])
        with torch.no_grad():
            reads.run()
    finally:
        files.close()
    return out
