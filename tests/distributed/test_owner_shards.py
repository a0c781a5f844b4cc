"""Shards written by their owners: with --use-distributed-optimizer every DP rank writes the part of
the weights and optimizer state it owns ("flat" entries of the global blocks), nothing is gathered.

* the files: every element of every saved tensor is stored exactly once over all ranks, each entry's
  crc32 matches its bytes, each DP rank writes about 1/dp of the bytes, and the entries put back
  together (a reader of this test's own) equal the saving run's weights and optimizer state;
* the loads (load_checkpoint): saved at dp 2 (bf16: fp32 main weights saved) and dp 4 (fp32), loaded
  into dp 1, 2 and 4 (with and without the distributed optimizer): weights, fp32 main weights, Adam
  moments and step equal the saving run's exactly; loaded at tp 2 x pp 2, the evaluation loss and the
  continued training equal the dp-1 load's within 1e-5.
"""

import glob
import json
import os
import zlib
from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megalite.checkpointing.sharded import quiet_single_process
from megalite.config import CheckpointConfig
from megalite.data.batches import MicroBatches
from megalite.data.mock_dataset import MockGPTDataset
from megalite.parallel.state import ParallelState
from megalite.training import Trainer
from megalite.training.mock import MockFeed
from tests.helpers.parity import GPT2_STYLE, tiny_config

STEPS = 4


def _cfg(dtype="float32", distopt=False, tp=1, pp=1):
    cfg = tiny_config(GPT2_STYLE, gbs=4, mbs=1, num_layers=4, tp=tp, pp=pp)
    return cfg.with_(
        model=replace(cfg.model, params_dtype=dtype),
        optim=replace(cfg.optim, use_distributed_optimizer=distopt),
        train=replace(cfg.train, train_iters=STEPS),
    )


def _state(trainer, out):
    """(weights, whole optimizer state) of a tp1 pp1 trainer, written by rank 0 to ``out`` (collective
    over DP; tensors do not travel back through the harness's queue)."""
    trainer.optimizer.finish_param_gather()
    full = trainer.optimizer.full_state_dict(include_main=True, to_cpu=True)
    model = {k: v.detach().clone() for k, v in trainer.chunks[0].state_dict().items()}
    full = {n: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()} for n, s in full.items()}
    if trainer.ps.rank == 0:
        torch.save({"model": model, "optim": full}, out)
    return out


def _save(ps, cfg, root, out=None):
    cfg = cfg.with_(checkpoint=CheckpointConfig(save=root), train=replace(cfg.train, exit_interval=STEPS // 2))
    trainer = Trainer(cfg, ps)
    ds = MockGPTDataset(cfg.model.seq_length, cfg.model.vocab_size, cfg.train.seed, STEPS * cfg.train.global_batch_size)
    trainer.train(ds, None)
    return _state(trainer, out) if out else None


def _load(ps, cfg, root, out):
    trainer = Trainer(cfg.with_(checkpoint=CheckpointConfig(load=root)), ps)
    assert trainer.checkpointer.load() == STEPS // 2
    return _state(trainer, out)


def _eval_and_continue(ps, cfg, root):
    cfg = cfg.with_(checkpoint=CheckpointConfig(load=root), train=replace(cfg.train, eval_iters=2))
    trainer = Trainer(cfg, ps)
    assert trainer.checkpointer.load() == STEPS // 2
    ds = MockGPTDataset(cfg.model.seq_length, cfg.model.vocab_size, 99, 2 * cfg.train.global_batch_size)
    valid = MicroBatches(ds, 0, cfg.train.micro_batch_size, trainer.m, ps) if trainer.needs_data else None
    eval_loss = trainer.evaluate(valid)
    feed = MockFeed(trainer, 2, consumed=trainer.state.consumed_samples)
    losses = [trainer.train_step(feed.next())["loss"] for _ in range(2)]
    return {"eval": eval_loss, "losses": losses, "last": ps.is_last_stage}


def _reassemble(d):
    """Every saved tensor put back together from the index entries; checks crc32 and single coverage."""
    entries = [e for f in sorted(glob.glob(os.path.join(d, "index_*.json"))) for e in json.load(open(f))]
    wanted = {}
    for e in entries:
        n = e["flat"][1] - e["flat"][0] if "flat" in e else None
        wanted[e["key"]] = torch.empty([n] if n is not None else e["sizes"], dtype=getattr(torch, e["dtype"]))
    with quiet_single_process():
        dcp.load(wanted, storage_reader=dcp.FileSystemReader(d))
    full, count = {}, {}
    for e in entries:
        t = wanted[e["key"]]
        assert zlib.crc32(t.contiguous().view(-1).view(torch.uint8).numpy()) == e["crc32"], e["key"]
        k = (e["prefix"], e["name"])
        full.setdefault(k, torch.zeros(e["shape"], dtype=t.dtype))
        count.setdefault(k, torch.zeros(e["shape"], dtype=torch.int32))
        box = tuple(slice(o, o + s) for o, s in zip(e["offsets"], e["sizes"]))
        for dst, src in ((full[k], t), (count[k], torch.ones_like(t, dtype=torch.int32))):
            if "flat" in e:
                block = dst[box].contiguous().view(-1)
                block[e["flat"][0] : e["flat"][1]] = src
                dst[box] = block.view(e["sizes"])
            else:
                dst[box] = src
    for k, c in count.items():
        assert bool((c == 1).all()), f"{k}: elements stored {int(c.min())}..{int(c.max())} times"
    return entries, full


def _assert_same_state(got, want, where):
    for name, w in want["model"].items():
        assert torch.equal(got["model"][name], w), f"{where}: weight {name}"
    for name, s in want["optim"].items():
        for k, v in s.items():
            g = got["optim"][name][k]
            assert torch.equal(g, v) if torch.is_tensor(v) else g == v, f"{where}: optimizer {name} {k}"


def _check_files(d, saved, dp, half):
    entries, full = _reassemble(d)
    assert any("flat" in e for e in entries)
    prefixes = {e["prefix"] for e in entries}
    assert prefixes == {"model", "optim.exp_avg", "optim.exp_avg_sq"} | ({"optim.param"} if half else set())
    for (prefix, name), t in full.items():
        src = saved["model"][name] if prefix == "model" else saved["optim"][name][prefix.split(".", 1)[1]]
        assert torch.equal(t, src[tuple(slice(0, s) for s in t.shape)].to(t.dtype)), (prefix, name)
    sizes = [os.path.getsize(os.path.join(d, f"__{r}_0.distcp")) for r in range(dp)]
    assert max(sizes) < 1.5 * sum(sizes) / dp, sizes  # each DP rank writes its share, none writes all


CASES = [(2, "bfloat16", [(1, False), (4, True)]), (4, "float32", [(1, False), (2, True)])]


@pytest.mark.slow
@pytest.mark.parametrize("dp,dtype,loads", CASES, ids=[f"dp{c[0]}-{c[1]}" for c in CASES])
def test_owner_written_shards_load_into_other_dp(tmp_path, dp, dtype, loads, run_distributed):
    root = str(tmp_path / f"dp{dp}")
    saved = torch.load(run_distributed(_save, dp, _cfg(dtype, distopt=True), root, str(tmp_path / "saved.pt"))[0])
    _check_files(os.path.join(root, "iter_0000002"), saved, dp, dtype != "float32")
    for world, distopt in loads:
        cfg = _cfg(dtype, distopt=distopt)
        out = str(tmp_path / f"loaded_{world}.pt")
        if world == 1:
            _load(ParallelState.single(), cfg, root, out)
        else:
            run_distributed(_load, world, cfg, root, out)
        got = torch.load(out)
        _assert_same_state(got, saved, f"dp {dp} -> dp {world}")


@pytest.mark.slow
def test_owner_written_shards_load_into_tp2_pp2(tmp_path, run_distributed):
    root = str(tmp_path / "dp4")
    run_distributed(_save, 4, _cfg(distopt=True), root)
    ref = _eval_and_continue(ParallelState.single(), _cfg(), root)
    for r in run_distributed(_eval_and_continue, 4, _cfg(tp=2, pp=2), root, tp=2, pp=2):
        if r["last"]:
            for a, b in zip([r["eval"]] + r["losses"], [ref["eval"]] + ref["losses"]):
                assert abs(a - b) <= 1e-5 * abs(b), (r, ref)
