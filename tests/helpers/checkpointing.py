"""The checkpoint tests' tiny run (4 layers, STEPS iterations, dropout on unless told) and a one-process
trainer that saves to and loads from one directory."""

from dataclasses import replace

from megalite.config import CheckpointConfig
from megalite.parallel.state import ParallelState
from megalite.training import Trainer
from tests.helpers.parity import GPT2_STYLE, tiny_config

STEPS = 4


def _cfg(style, tp=1, pp=1, vp=1, dp=1, dropout=0.1, **optim):
    cfg = tiny_config(
        style,
        gbs=4,
        mbs=1 if dp * pp > 1 else 2,
        num_layers=4,
        tp=tp,
        pp=pp,
        vp=vp,
        schedule="interleaved_1f1b" if vp > 1 else None,
    )
    return cfg.with_(
        model=replace(cfg.model, hidden_dropout=dropout, attention_dropout=dropout),
        optim=replace(cfg.optim, **optim),
        train=replace(cfg.train, train_iters=STEPS),
    )


def _trainer(root, fmt="sharded", **model):
    cfg = _cfg(GPT2_STYLE, dropout=0.0)
    cfg = cfg.with_(
        model=replace(cfg.model, **model), checkpoint=CheckpointConfig(save=root, load=root, ckpt_format=fmt)
    )
    return Trainer(cfg, ParallelState.single())
