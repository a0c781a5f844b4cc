"""Megatron-Core's torch_dist checkpoints, against megatron-core itself.

megatron-core runs in its own interpreter (this file run as a script: ``save`` or
``load``), the converter in another (``tools/checkpoint/convert.py`` as users run it):

- megatron-core GPTModel -> ``dist_checkpointing.save`` (with Megatron-LM's common state:
  args, iteration) -> convert.py --loader megatron -> megalite: megatron-core's logits.
- megalite -> convert.py --saver megatron --target-format torch_dist -> megatron-core's
  ``dist_checkpointing.load`` with strict handling, then ``load_state_dict(strict=True)``: megalite's logits.
- pretrain_gpt.py's load path (load_checkpoint) reads the torch_dist directory in place, in one
  process and over tp 2 x pp 2: megatron-core's logits, its iteration and consumed samples.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from typing import Dict

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IDS = dict(shape=(2, 12), seed=1)


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, IDS["shape"], generator=torch.Generator().manual_seed(IDS["seed"]))


# -- the megatron-core side (run as a script: a fresh interpreter) ----------------------------------
def _megatron_core_setup():
    """gloo, one rank, and stand-ins for the CUDA calls megatron-core's writer and forward make on CPU."""
    import contextlib
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._process_memory = lambda: 0  # its memory log needs psutil
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


def _megatron_core_logits(model, vocab: int) -> torch.Tensor:
    mask = torch.triu(torch.ones(12, 12, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        return model(_ids(vocab), torch.arange(12)[None].expand(2, 12), mask)[..., :vocab]


def _megatron_core_main(action: str, root: str, *styles: str) -> None:
    """``save``: each style's model as Megatron-LM's save_checkpoint(ckpt_format="torch_dist") lays it out
    under root/<style>; ``load``: root/<style> into a model of other weights, every key of the checkpoint
    and of the model meeting (StrictHandling.RAISE_ALL, then strict=True). Logits go to root/<style>."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from tests.helpers.convert import VOCAB
    from tests.helpers.megatron_core import _megatron_args, _megatron_core_model

    _megatron_core_setup()
    for style in styles:
        out = os.path.join(root, style)
        torch.manual_seed(3 if action == "save" else 11)
        model = _megatron_core_model(style)
        if action == "save":
            args = _megatron_args(style)
            args.ckpt_format, args.consumed_train_samples = "torch_dist", 56
            d = os.path.join(out, "iter_0000007")
            os.makedirs(d)
            dist_checkpointing.save(
                {
                    "args": args,
                    "checkpoint_version": 3.0,
                    "iteration": 7,
                    "model": model.sharded_state_dict(),
                    "num_floating_point_operations_so_far": 0,
                    "opt_param_scheduler": {"num_steps": 56},
                },
                d,
            )
            with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("7")
        else:
            with open(os.path.join(out, "latest_checkpointed_iteration.txt")) as f:
                d = os.path.join(out, f"iter_{int(f.read()):07d}")
            loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, d, strict=StrictHandling.RAISE_ALL)
            model.load_state_dict(loaded["model"], strict=True)
        torch.save(_megatron_core_logits(model, VOCAB), os.path.join(out, f"logits_{action}.pt"))


def _megatron_core(launch, action: str, root, styles) -> Dict[str, torch.Tensor]:
    """This file as megatron-core's script, in an interpreter (and gloo world) of its own started by ``launch``."""
    p = launch(
        [sys.executable, __file__, action, str(root), *styles], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return {s: torch.load(os.path.join(root, s, f"logits_{action}.pt")) for s in styles}


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    _megatron_core_main(*sys.argv[1:])
    sys.exit(0)

# -- the tests (megalite's side) -----------------------------------------------------------------------
from megalite.checkpointing import load_checkpoint, save_checkpoint  # noqa: E402
from megalite.checkpointing.run import RunParts
from megalite.interop import checkpoint_formats
from megalite.training import Trainer  # noqa: E402
from tests.helpers.convert import VOCAB, _convert, loaded, make_trainer, megalite_logits, parts  # noqa: E402
from tests.helpers.parity import tiny_config  # noqa: E402

STYLES = ("gpt2", "llama")


@pytest.fixture(scope="module")
def saved_by_megatron_core(tmp_path_factory, launch):
    """Both styles saved by megatron-core (one interpreter): (root, {style: its logits})."""
    pytest.importorskip("megatron.core")
    root = tmp_path_factory.mktemp("megatron_core")
    return root, _megatron_core(launch, "save", root, STYLES)


def _load_and_save(ps, cfg, src: str, dst: str) -> int:
    """pretrain_gpt.py's load path on one rank of a tp x pp run, then a megalite save of what it holds."""
    t = Trainer(cfg, ps)
    it = load_checkpoint(
        RunParts(t.cfg, ps, t.chunks, t.optimizer, t.scheduler, t.state, t.tracker), src, formats=checkpoint_formats()
    )
    save_checkpoint(RunParts(t.cfg, ps, t.chunks, t.optimizer, t.scheduler, t.state, t.tracker), dst)
    return it


@pytest.mark.slow
@pytest.mark.parametrize("style", STYLES)
def test_megatron_core_torch_dist_reads_with_its_logits(tmp_path, saved_by_megatron_core, style, run_distributed):
    root, logits = saved_by_megatron_core
    theirs, src = logits[style], root / style
    assert theirs.abs().max() > 1.0
    # convert.py --loader megatron, in a fresh interpreter
    p = _convert(
        "--loader",
        "megatron",
        "--saver",
        "megalite",
        "--load-dir",
        src,
        "--save-dir",
        tmp_path / "ml",
        "--true-vocab-size",
        VOCAB,
    )
    assert p.returncode == 0, p.stderr
    assert "torch_dist" in p.stdout and "optimizer state is not converted" in p.stdout
    assert (megalite_logits(loaded(style, tmp_path / "ml"), _ids(VOCAB)) - theirs).abs().max() < 1e-4
    # pretrain_gpt.py --load reads it in place: weights and counters, in one process ...
    t = make_trainer(style, init_method_std=0.01)
    assert load_checkpoint(parts(t), str(src), formats=checkpoint_formats()) == 7
    assert (t.state.iteration, t.state.consumed_samples, t.scheduler.num_steps) == (7, 56, 7)
    assert (megalite_logits(t, _ids(VOCAB)) - theirs).abs().max() < 1e-4
    # ... and split over tp 2 x pp 2 (one layer per stage; gpt2's tied head on the last stage)
    cfg = tiny_config(tp=2, pp=2).with_(model=t.cfg.model)
    assert run_distributed(_load_and_save, 4, cfg, str(src), str(tmp_path / "tp2pp2"), tp=2, pp=2) == [7] * 4
    assert (megalite_logits(loaded(style, tmp_path / "tp2pp2"), _ids(VOCAB)) - theirs).abs().max() < 1e-4
    # ... and into FSDP's shards (dp 2, optim_grads_params): each rank's rows of every weight
    fsdp = tiny_config().with_(model=t.cfg.model)
    fsdp = fsdp.with_(optim=replace(fsdp.optim, data_parallel_sharding_strategy="optim_grads_params"))
    assert run_distributed(_load_and_save, 2, fsdp, str(src), str(tmp_path / "fsdp")) == [7] * 2
    assert (megalite_logits(loaded(style, tmp_path / "fsdp"), _ids(VOCAB)) - theirs).abs().max() < 1e-4


@pytest.mark.slow
def test_megalite_to_torch_dist_loads_strictly_into_megatron_core(tmp_path, launch):
    pytest.importorskip("megatron.core")
    ours = {}
    for style in STYLES:
        t = make_trainer(style)
        save_checkpoint(parts(t), str(tmp_path / "ml" / style))
        ours[style] = megalite_logits(t, _ids(VOCAB))
        p = _convert(
            "--loader",
            "megalite",
            "--saver",
            "megatron",
            "--target-format",
            "torch_dist",
            "--load-dir",
            tmp_path / "ml" / style,
            "--save-dir",
            tmp_path / "mc" / style,
        )
        assert p.returncode == 0, p.stderr
        assert sorted(os.listdir(tmp_path / "mc" / style / "iter_0000000")) == [
            ".metadata",
            "__0_0.distcp",
            "__0_1.distcp",
            "__0_2.distcp",
            "__0_3.distcp",
            "common.pt",
            "metadata.json",
        ]
    theirs = _megatron_core(launch, "load", tmp_path / "mc", STYLES)
    for style in STYLES:
        assert ours[style].abs().max() > 1.0
        assert (theirs[style] - ours[style]).abs().max() < 1e-4
