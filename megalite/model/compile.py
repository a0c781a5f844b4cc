"""--compile: regional torch.compile of the transformer layers, and the log lines about it.

Each TransformerLayer is compiled on its own, so compile time does not grow with depth: layers of
one shape share their graphs. Inside a layer, code dynamo should not trace runs eagerly behind a
clean graph break (parallel/eager.py): each tensor-parallel collective, the selective-recompute
checkpoint, the context-parallel attention and an MoE block (its token counts per expert change
every step; traced, it would recompile): an MoE layer has its attention, norms and residuals compiled.
Full recomputation wraps compiled layers: the checkpoint's no-grad forward and its recomputation are
two graphs (grad mode is part of the guard). Pipeline stages compile the layers they hold.

``CompileWatch`` reads dynamo's counters after each iteration: the graphs and compile time of the
first one, then every recompilation (a new graph), for the log.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import warnings
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

logger = logging.getLogger("megalite")
BACKEND = "inductor"  # the parity tests on several CPU ranks set "aot_eager" (tests/helpers/compile.py)


def _cpp_compiler() -> Optional[str]:
    """The C++ compiler inductor would build CPU kernels with (None: there is none)."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else []
    return next((c for c in [*names, "g++", "c++", "clang++"] if shutil.which(c)), None)


def cannot_compile(device: torch.device) -> Optional[str]:
    """Why the layers must run eagerly on ``device`` (None: they can be compiled)."""
    if not hasattr(torch, "compile"):  # pragma: no cover - torch < 2.0
        return "this torch has no torch.compile"
    if BACKEND == "inductor" and device.type == "cpu" and _cpp_compiler() is None:
        return "inductor on CPU needs a C++ compiler (none found: set CXX or install g++)"
    return None


_CALLERS: Dict[str, Callable] = {}  # backend -> the compiled caller of every layer


def _call(layer: nn.Module, *args, **kwargs):
    return nn.Module.__call__(layer, *args, **kwargs)


def compile_layer(layer: nn.Module) -> None:
    """Run ``layer`` (a TransformerLayer) compiled from now on; its parameters and their names are unchanged.

    The layer calls one compiled function shared by all layers, which holds no layer: nn.Module.compile
    would store a compiled bound method of the layer on the layer, a reference cycle that keeps a
    dropped model's memory until Python's cycle collector runs.
    """
    if BACKEND not in _CALLERS:
        _CALLERS[BACKEND] = torch.compile(_call, backend=BACKEND)
    layer.compiled_call = _CALLERS[BACKEND]
    _allow_a_graph_per_layer()


_layers_compiled = 0


def _allow_a_graph_per_layer() -> None:
    """On a torch that guards on each layer object (torch < 2.5 by default: modules are not inlined), every
    layer compiles its own graph, and past dynamo's recompile limit (8) the rest would silently run eagerly:
    raise the limit to what the compiled layers need (two graphs each, with grad and without)."""
    global _layers_compiled
    _layers_compiled += 1
    import torch._dynamo.config as dynamo_config

    with warnings.catch_warnings():  # newer torch deprecates the flag (always on)
        warnings.simplefilter("ignore")
        if getattr(dynamo_config, "inline_inbuilt_nn_modules", True):
            return
    need = 2 * _layers_compiled + 8
    for name in ("cache_size_limit", "recompile_limit"):
        if getattr(dynamo_config, name, need) < need:
            setattr(dynamo_config, name, need)


def run_compiled(layer: nn.Module, *args, **kwargs):
    """``layer``'s forward through its compiled caller; if dynamo or the backend cannot compile it, say so
    once (for this layer on this rank) and run it eagerly from then on instead of stopping the run.

    Dynamo compiles a layer's pieces (between graph breaks) as it reaches them, so a failure in a later
    piece comes after the earlier ones ran: the eager rerun repeats them. Every rank repeats the same
    pieces (their collectives stay matched) and the first try's outputs are dropped; what it changed
    stays changed (an FP8 delayed-scaling history records that call twice, random draws advance)."""
    try:
        return layer.compiled_call(layer, *args, **kwargs)
    except torch._dynamo.exc.TorchDynamoException as err:
        layer.compiled_call = None
        first = (str(err).strip().splitlines() or [""])[0][:200]
        logger.warning(
            f"compile: layer {layer.layer_number} could not be compiled ({type(err).__name__}: {first}); "
            f"it runs eagerly from now on"
        )
        return nn.Module.__call__(layer, *args, **kwargs)


def describe(layers: int, moe: int, skipped: Optional[str], recompute: Optional[str], pipeline: bool = False) -> str:
    """The start-of-run line: what was compiled (this rank's ``layers``, ``moe`` of them MoE layers; ``pipeline``:
    the rank holds some stages only) and what runs eagerly inside."""
    held = f"{layers} transformer layers" + (" of this pipeline rank" if pipeline else "")
    if skipped:
        return f"compile: skipped, {held} run eagerly: {skipped}"
    parts = [f"compile: {held} compiled regionally ({BACKEND})"]
    if moe:
        parts.append(f"{moe} MoE layers: attention, norms and residuals only (the MoE block runs eagerly)")
    if recompute == "selective":
        parts.append("the recomputed core attention runs eagerly")
    elif recompute == "full":
        parts.append("inside full recomputation")
    return "; ".join(parts)


def _counted_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _compile_seconds() -> float:
    """Dynamo's (and the backend's) compile time so far: the forward frames and the backward graphs."""
    from torch._dynamo import utils

    compilation_time_metrics = getattr(utils, "compilation_time_metrics", {})  # 0 s if a torch renames it
    return sum(
        sum(times)
        for name, times in compilation_time_metrics.items()
        if name.endswith("compile_inner") or name.endswith("bw_compiler")
    )


def _graphs(n: int) -> str:
    return f"{n} graph{'s' * (n != 1)}"


class CompileWatch:
    """Graphs and compile time of the first iteration, recompilations after it (log lines)."""

    def __init__(self) -> None:
        self.graphs, self.seconds, self.start = _counted_graphs(), _compile_seconds(), time.perf_counter()
        self.first: Optional[int] = None  # graphs of the first iteration
        self.recompiles = 0

    def after_step(self, iteration: int) -> List[str]:
        """Lines to log after ``iteration`` (none when nothing was compiled in it)."""
        graphs = _counted_graphs()
        new, self.graphs = graphs - self.graphs, graphs
        if self.first is None:
            self.first = new
            took = time.perf_counter() - self.start
            spent = _compile_seconds() - self.seconds
            return [
                f"compile: {_graphs(new)} compiled in iteration {iteration}, {spent:.1f} s of compile time "
                f"(the iteration took {took:.1f} s)"
            ]
        if new <= 0:
            return []
        self.recompiles += new
        return [f"compile: {_graphs(new)} recompiled in iteration {iteration} ({self.recompiles} since the first)"]

    def after_evaluation(self, iteration: int) -> List[str]:
        """The graphs an evaluation compiled (its no-grad forward), not counted as recompilations."""
        graphs = _counted_graphs()
        new, self.graphs = graphs - self.graphs, graphs
        return [f"compile: {_graphs(new)} compiled for the evaluation at iteration {iteration}"] if new > 0 else []
