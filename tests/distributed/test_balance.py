"""Uneven per-stage splits train like one process; a measured split is agreed on; checkpoints cross splits.

* a given ``--pipeline-stage-layers`` split (one Megatron's first/last flags cannot express) equals
  the single-process run: loss, grad norm and final weights within 1e-5;
* ``--pipeline-balance measured``: every rank trains with the same split, and equals the single-process run;
* a sharded checkpoint saved with one split loads into another and training goes on as if
  uninterrupted; a torch-format one (per-rank files) is refused with the split named.
"""

from dataclasses import replace

import pytest

from megalite.checkpointing import CheckpointError
from megalite.config import CheckpointConfig
from megalite.training import Trainer
from megalite.training.mock import MockFeed
from tests.helpers.parity import (
    GPT2_STYLE,
    LLAMA_STYLE,
    _train,
    assert_close_run,
    reference_run,
    run_steps,
    tiny_config,
)

STEPS = 3


def _cfg(style, pp, vp, m, split=None, balance="even", layers=8):
    cfg = tiny_config(
        style, gbs=m, mbs=1, num_layers=layers, pp=pp, vp=vp, schedule="interleaved_1f1b" if vp > 1 else "1f1b"
    )
    return cfg.with_(parallel=replace(cfg.parallel, pipeline_stage_layers=split, pipeline_balance=balance))


@pytest.mark.parametrize(
    "style, pp, vp, m, split",
    [
        ("untied", 2, 2, 4, (3, 1, 2, 2)),  # interleaved: chunk sizes differ on one rank
        ("tied", 4, 1, 4, (3, 2, 2, 1)),
    ],
)
def test_given_split_matches_single_process(style, pp, vp, m, split, run_distributed):
    model = GPT2_STYLE if style == "tied" else LLAMA_STYLE
    cfg = _cfg(model, pp, vp, m, split)
    ref = reference_run(_cfg(model, pp, vp, m), STEPS)
    results = run_distributed(run_steps, pp, cfg, STEPS, ref["state"], _split_of, pp=pp)
    held = {r["rank"] + pp * c: len(layers) for r in results for c, layers in enumerate(r["layers"])}
    assert tuple(held[s] for s in range(pp * vp)) == split  # the chunks really hold the split
    assert_close_run(results, ref)


def _split_of(trainer):
    return {
        "split": trainer.cfg.parallel.pipeline_stage_layers,
        "layers": [list(c.decoder.layers.keys()) for c in trainer.chunks],
    }


def test_measured_split_is_agreed_and_matches_single_process(run_distributed):
    cfg = _cfg(LLAMA_STYLE, 2, 1, 4, balance="measured", layers=6)
    ref = reference_run(cfg.with_(parallel=replace(cfg.parallel, pipeline_balance="even")), STEPS)
    results = run_distributed(run_steps, 2, cfg, STEPS, ref["state"], _split_of, pp=2)
    split = results[0]["split"]
    assert split is not None and sum(split) == 6 and all(r["split"] == split for r in results)
    assert [int(k) for r in results for k in r["layers"][0]] == list(range(6))  # the split, in order
    assert len(results[0]["layers"][0]) == split[0]
    assert_close_run(results, ref)


def _save(ps, cfg, root, fmt):
    trainer, _, _ = _train(cfg, ps, 2)
    trainer.state.iteration, trainer.state.consumed_samples = 2, 2 * cfg.train.global_batch_size
    trainer.checkpointer.cfg = trainer.cfg.with_(checkpoint=CheckpointConfig(save=root, ckpt_format=fmt))
    trainer.checkpointer.save()


def _load_and_continue(ps, cfg, sharded, torch_root):
    trainer = Trainer(cfg.with_(checkpoint=CheckpointConfig(load=sharded)), ps)
    trainer.checkpointer.load()
    feed = MockFeed(trainer, 2, consumed=trainer.state.consumed_samples)
    losses = [trainer.train_step(feed.next())["loss"] for _ in range(2)]
    refused = None
    try:
        Trainer(cfg.with_(checkpoint=CheckpointConfig(load=torch_root)), ps).checkpointer.load()
    except CheckpointError as e:
        refused = str(e)
    return {"losses": losses, "last": ps.is_last_stage, "refused": refused}


def test_checkpoints_cross_splits(tmp_path, run_distributed):
    sharded, torch_root = str(tmp_path / "sharded"), str(tmp_path / "torch")
    a, b = _cfg(GPT2_STYLE, 2, 1, 2, (3, 1), layers=4), _cfg(GPT2_STYLE, 2, 1, 2, (1, 3), layers=4)
    ref = reference_run(_cfg(GPT2_STYLE, 2, 1, 2, layers=4), 4)
    run_distributed(_save, 2, a, sharded, "sharded", pp=2)
    run_distributed(_save, 2, a, torch_root, "torch", pp=2)
    results = run_distributed(_load_and_continue, 2, b, sharded, torch_root, pp=2)
    last = next(r for r in results if r["last"])
    for got, want in zip(last["losses"], ref["losses"][2:]):
        assert abs(got - want) <= 1e-5 * abs(want), (last["losses"], ref["losses"])
    for r in results:
        assert r["refused"] is not None and "layers per stage: 3,1" in r["refused"] and "(1,3)" in r["refused"]
        assert "\n" not in r["refused"]
