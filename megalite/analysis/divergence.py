"""Where two runs part: read two captures of one iteration and name the first tensor that differs.

A capture (megalite.testing.capture, written by tools/compare_runs.py) holds, as boxes of full
tensors written by every rank, the weights, activations, activation gradients and parameter
gradients of one iteration. Here the boxes are put back together (every element must be written
exactly once: a missing rank file or box is an error naming it), the tensors are put in the
order the iteration made them, and each pair is checked against a tolerance band::

    forward    embedding weights, embedding output, then per layer L: its weights, its output;
               final norm weights and output, output layer weight, logits, loss
    backward   from the output back: d logits, output layer grad, d final norm output, its grads,
               then per layer L (last first): d output of L (= layer L+1's input gradient), L's grads;
               d embedding output, embedding grads

A pair is over the band when max|a - b| > atol + rtol * scale, where ``scale`` is the largest
magnitude of that kind of tensor in the same layer on either side (so the gradient of a bias that
is zero but for round-off, e.g. the attention key bias, is judged against its layer's gradients,
not against its own noise). The relative difference shown is max|a - b| / scale.
"""

from __future__ import annotations

import glob
import math
import os
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from megalite.checkpointing.safe_load import safe_torch_load
from megalite.model.spec import FINAL_NORM, OUTPUT_LAYER

# Default bands: (rtol, atol) by the less precise dtype of the two sides.
BANDS = {"float32": (1e-4, 0.0), "float16": (1e-2, 0.0), "bfloat16": (5e-2, 0.0)}
_RANK_FILE = re.compile(r"rank_(\d+)\.pt$")
_HEAD = 10**6  # layer position of the final norm (the output layer and logits follow it)
KIND_WORDS = {"weight": "weight", "activation": "output", "act_grad": "d(output)", "grad": "grad"}


class CaptureError(ValueError):
    """A capture directory that cannot be read or is incomplete (one line naming the file and what to do)."""


@dataclass
class Capture:
    """One side: full tensors by (kind, name), their ordering index, and the writers' meta."""

    tensors: Dict[Tuple[str, str], torch.Tensor]
    index: Dict[Tuple[str, str], int]
    meta: dict
    path: str

    @property
    def dtype(self) -> str:
        return self.meta.get("dtype", "float32")

    def describe(self) -> str:
        m = self.meta
        sp = " sp" if m.get("sequence_parallel") else ""
        vp = f" vp {m['vp']}" if m.get("vp", 1) > 1 else ""
        cp = f" cp {m['cp']}" if m.get("cp", 1) > 1 else ""
        return f"tp {m['tp']}{cp} pp {m['pp']} dp {m['dp']}{vp}{sp}, {m['dtype']}, {m['micro_batches']} micro-batches"


def load_capture(path: str) -> Capture:
    """Read every rank's file under ``path`` and assemble the full tensors (CaptureError if incomplete)."""
    if not os.path.isdir(path):
        raise CaptureError(
            f"{path}: no such capture directory (write one with tools/compare_runs.py "
            f"--capture-dir {path} -- <pretrain_gpt.py flags>)"
        )
    files = {int(m.group(1)): f for f in glob.glob(os.path.join(path, "rank_*.pt")) if (m := _RANK_FILE.search(f))}
    if not files:
        raise CaptureError(f"{path}: holds no rank_<N>.pt files; it is not a compare_runs capture")
    boxes: Dict[Tuple[str, str], list] = {}
    index: Dict[Tuple[str, str], int] = {}
    meta: Optional[dict] = None
    for rank in sorted(files):
        try:
            blob = safe_torch_load(files[rank])
            m, pieces = blob["meta"], blob["pieces"]
        except Exception as e:  # noqa: BLE001 - any unreadable file is one line
            raise CaptureError(
                f"{files[rank]}: unreadable capture file ({' '.join(str(e).split())[:160]}); capture this side again"
            ) from None
        meta = meta or m
        for p in pieces:
            key = (p["kind"], p["name"])
            boxes.setdefault(key, []).append(p)
            index[key] = max(index.get(key, 0), int(p["index"]))
    missing = sorted(set(range(meta["world"])) - set(files))
    if missing:
        raise CaptureError(
            f"{path}: the capture of {meta['world']} ranks lacks the files of rank(s) "
            f"{', '.join(map(str, missing))}; capture this side again"
        )
    tensors = {key: _assemble(path, key, parts) for key, parts in boxes.items()}
    return Capture(tensors, index, meta, path)


def _assemble(path: str, key: Tuple[str, str], parts: list) -> torch.Tensor:
    shape = tuple(parts[0]["shape"])
    full = torch.zeros(shape)
    seen = torch.zeros(shape, dtype=torch.int32)
    for p in parts:
        box = tuple(slice(o, o + s) for o, s in zip(p["offsets"], p["data"].shape))
        full[box] = p["data"].float()
        seen[box] += 1
    if int(seen.min()) != 1 or int(seen.max()) != 1:
        what = "lacks elements" if int(seen.min()) == 0 else "has elements written twice"
        raise CaptureError(f"{path}: {key[0]} {key[1]} {what}; the capture is incomplete (capture this side again)")
    return full


def layer_of(name: str) -> int:
    """Position of a tensor's layer in the model: -1 embedding, L for decoder.layers.L, then the head."""
    if name == "embedding" or name.startswith("embedding."):
        return -1
    m = re.match(r"decoder\.layers\.(\d+)(\.|$)", name)
    if m:
        return int(m.group(1))
    if name.startswith(FINAL_NORM):
        return _HEAD
    if name in (OUTPUT_LAYER, "logits"):
        return _HEAD + 1
    return _HEAD + 2  # loss


def layer_label(pos: int) -> str:
    return {-1: "embedding", _HEAD: "final norm", _HEAD + 1: "output", _HEAD + 2: "loss"}.get(pos, str(pos))


def order_key(kind: str, name: str, index: int) -> tuple:
    """Execution order: forward (weights before the output they make), then backward from the output."""
    pos = layer_of(name)
    if kind in ("weight", "activation"):
        return (0, pos, 0 if kind == "weight" else 1, index)
    return (1, -pos, 0 if kind == "act_grad" else 1, index)


@dataclass
class Row:
    kind: str
    name: str
    layer: str
    max_abs: float
    rel: float
    over: bool
    note: str = ""  # why a pair could not be compared (missing on a side, other shape)

    @property
    def tensor(self) -> str:
        return f"{KIND_WORDS[self.kind]} {self.name}"


@dataclass
class Report:
    rows: List[Row]
    rtol: float
    atol: float
    band_dtype: str
    loss_a: Optional[float]
    loss_b: Optional[float]

    @property
    def first(self) -> Optional[Row]:
        return next((r for r in self.rows if r.over), None)

    def verdict(self) -> str:
        """The one line: the first tensor over the band, or that all agree."""
        band = f"rtol {self.rtol:.0e}, atol {self.atol:.0e} ({self.band_dtype} band)"
        first = self.first
        if first is None:
            return f"agree: all {len(self.rows)} tensors within the band ({band})"
        before = self.rows.index(first)
        section = "forward" if first.kind in ("weight", "activation") else "backward"
        what = first.note or f"max abs diff {first.max_abs:.2e}, relative {first.rel:.2e}"
        layer = f"layer {first.layer}" if first.layer.isdigit() else first.layer
        return (
            f"first divergence: {first.tensor} ({layer}, {section}): {what}, over the band ({band}); "
            f"the {before} tensor(s) before it agree"
        )

    def table(self) -> str:
        width = max([len(r.tensor) for r in self.rows] + [6])
        lines = [f"{'#':>4}  {'layer':<10}  {'tensor':<{width}}  {'max abs diff':>12}  {'relative':>9}  band"]
        for i, r in enumerate(self.rows, 1):
            band = "over" if r.over else "within"
            if r.note:
                lines.append(f"{i:>4}  {r.layer:<10}  {r.tensor:<{width}}  {'-':>12}  {'-':>9}  {band}: {r.note}")
                continue
            lines.append(f"{i:>4}  {r.layer:<10}  {r.tensor:<{width}}  {r.max_abs:>12.3e}  {r.rel:>9.2e}  {band}")
        return "\n".join(lines)


def default_band(a: Capture, b: Capture) -> Tuple[str, float, float]:
    """(the less precise dtype, rtol, atol) for two captures: fp32 unless either side is fp16/bf16."""
    dtypes = {a.dtype, b.dtype}
    worst = "bfloat16" if "bfloat16" in dtypes else "float16" if "float16" in dtypes else "float32"
    return (worst,) + BANDS[worst]


def _loss(c: Capture) -> Optional[float]:
    t = c.tensors.get(("activation", "loss"))
    return float(t[0]) if t is not None else None


def compare(a: Capture, b: Capture, rtol: Optional[float] = None, atol: Optional[float] = None) -> Report:
    """Every tensor of either side, in execution order, with its difference and band verdict. ValueError
    (one line) for an ``rtol`` or ``atol`` that is nan, infinite or negative: with nan every comparison is
    False and any two runs would agree."""
    for name, value in (("rtol", rtol), ("atol", atol)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"compare: {name} must be a finite number >= 0, got {value}")
    band_dtype, d_rtol, d_atol = default_band(a, b)
    rtol = d_rtol if rtol is None else rtol
    atol = d_atol if atol is None else atol
    keys = sorted(
        set(a.tensors) | set(b.tensors), key=lambda k: order_key(k[0], k[1], a.index.get(k, b.index.get(k, 0)))
    )
    scale: Dict[Tuple[str, int], float] = {}
    for side in (a, b):
        for (kind, name), t in side.tensors.items():
            group = (kind, layer_of(name))
            scale[group] = max(scale.get(group, 0.0), _max_abs(t))
    rows = []
    for kind, name in keys:
        ta, tb = a.tensors.get((kind, name)), b.tensors.get((kind, name))
        label = layer_label(layer_of(name))
        if ta is None or tb is None:
            rows.append(Row(kind, name, label, math.inf, math.inf, True, f"only in {'A' if tb is None else 'B'}"))
            continue
        if ta.shape != tb.shape:
            rows.append(
                Row(kind, name, label, math.inf, math.inf, True, f"shape {list(ta.shape)} in A, {list(tb.shape)} in B")
            )
            continue
        finite = torch.isfinite(ta)
        if not _same_nonfinite(ta, tb, finite):
            bad_a, bad_b = int((~finite).sum()), int((~torch.isfinite(tb)).sum())
            rows.append(
                Row(kind, name, label, math.inf, math.inf, True, f"inf/NaN in {bad_a} element(s) of A, {bad_b} of B")
            )
            continue
        diff = (ta - tb).abs()[finite]
        max_abs = float(diff.max()) if diff.numel() else 0.0
        s = scale[(kind, layer_of(name))]
        rel = max_abs / s if s > 0 else 0.0
        rows.append(Row(kind, name, label, max_abs, rel, max_abs > atol + rtol * s))
    return Report(rows, rtol, atol, band_dtype, _loss(a), _loss(b))


def _max_abs(t: torch.Tensor) -> float:
    finite = t[torch.isfinite(t)]
    return float(finite.abs().max()) if finite.numel() else 0.0


def _same_nonfinite(ta: torch.Tensor, tb: torch.Tensor, finite_a: torch.Tensor) -> bool:
    """Both sides have the same NaN/inf elements (the finite rest is then compared with the band)."""
    if bool(finite_a.all()) and bool(torch.isfinite(tb).all()):
        return True
    if not torch.equal(finite_a, torch.isfinite(tb)):
        return False
    inf = float("inf")
    return torch.equal(
        ta[~finite_a].nan_to_num(nan=0.0, posinf=inf, neginf=-inf),
        tb[~finite_a].nan_to_num(nan=0.0, posinf=inf, neginf=-inf),
    )
