"""A model's parameters as checkpoints and the model spec name them: each grouped expert parameter
([E_local, ...], megalite.moe.experts.GroupedLinear) once per expert, under its per-expert name, in the
order per-expert parameters had (expert by expert: fc1 weight, bias, fc2 weight, bias)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import List

import torch
from torch import nn

from megalite.tensor_parallel.layers import per_expert_names


def per_expert_parameters(model: nn.Module) -> List[SimpleNamespace]:
    """(name, tensor, partition_dim, param, module) of every parameter, grouped ones cut per expert."""
    out: List[SimpleNamespace] = []
    run: List[List[SimpleNamespace]] = []
    for name, p in model.named_parameters():
        module = model.get_submodule(name.rpartition(".")[0])
        names = per_expert_names(name, p)
        if not names:
            out += [x for group in zip(*run) for x in group]
            run = []
            out.append(SimpleNamespace(name=name, tensor=p, partition_dim=p.partition_dim, param=p, module=module))
            continue
        dim = p.partition_dim - 1 if p.partition_dim >= 0 else -1  # the grouped tensor's leading expert dim
        run.append(
            [
                SimpleNamespace(name=n, tensor=t, partition_dim=dim, param=p, module=module)
                for n, t in zip(names, p.unbind(0))
            ]
        )
    out += [x for group in zip(*run) for x in group]
    return out


def per_expert_tensors(model: nn.Module) -> dict:
    """Name -> tensor (detached) of :func:`per_expert_parameters`."""
    with torch.no_grad():
        return {x.name: x.tensor.detach() for x in per_expert_parameters(model)}
