"""--compile parity: the same run eager and with compiled layers, compared step by step."""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Tuple

import numpy as np
import torch

from megalite.config import Config
from megalite.model import compile as compile_mod
from megalite.parallel.state import ParallelState
from megalite.training.mock import train_mock
from tests.helpers.parity import full_params


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _run(ps: ParallelState, cfg: Config, steps: int) -> Dict[str, np.ndarray]:
    """Losses, grad norms, the last step's gradients and the final parameters of this rank."""
    trainer, losses, norms = train_mock(cfg, ps, steps)
    grads = torch.cat([p.main_grad.reshape(-1).float() for c in trainer.chunks for p in c.parameters()])
    return {
        "losses": np.array([np.nan if v is None else v for v in losses]),
        "norms": np.array(norms),
        "grads": grads.numpy().copy(),
        "params": full_params(trainer).numpy().copy(),
    }


def eager_and_compiled(
    ps: ParallelState, cases: List[Tuple[str, Config]], steps: int = 2, backend: str = "inductor"
) -> Dict[str, dict]:
    """For each (name, config): the run eager and with --compile (``backend``), and how many graphs the
    compiled run made (dynamo starts afresh for each case: a cache full of another case's graphs could
    send layers back to eager and hide a difference)."""
    out, default = {}, compile_mod.BACKEND
    compile_mod.BACKEND = backend
    try:
        for name, cfg in cases:
            eager = _run(ps, cfg.with_(model=replace(cfg.model, torch_compile=False)), steps)
            torch._dynamo.reset()
            before = _graphs()
            compiled = _run(ps, cfg.with_(model=replace(cfg.model, torch_compile=True)), steps)
            out[name] = {"eager": eager, "compiled": compiled, "graphs": _graphs() - before}
    finally:
        compile_mod.BACKEND = default
    return out


def assert_same(name: str, pair: dict, tol: float = 1e-5) -> None:
    """Compiled within ``tol`` (relative) of eager: every step's loss and grad norm, the last gradients,
    the final parameters; and something was compiled."""
    a, b = pair["eager"], pair["compiled"]
    assert pair["graphs"] > 0, f"{name}: nothing was compiled"
    for key in ("losses", "norms", "grads", "params"):
        x, y = a[key], b[key]
        finite = ~np.isnan(x)
        assert np.array_equal(finite, ~np.isnan(y)), f"{name}: {key} present on different steps"
        err = np.abs(x[finite] - y[finite]).max(initial=0.0) / max(np.abs(x[finite]).max(initial=0.0), 1e-12)
        assert err <= tol, f"{name}: compiled {key} differ from eager by {err:.2e} (relative to the largest)"
