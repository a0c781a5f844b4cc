"""The sharded load: reading owner-written (flat) entries into any layout, checksums, damaged files.

* flat entries written at dp 2 and dp 4 with the distributed optimizer load into dp 1, 2, 4 and
  other tp/pp layouts, every weight and optimizer tensor equal to what was saved;
* flipped bytes in a shard and shifted offsets in an index are refused with one line naming the
  file; a missing, truncated or zeroed shard, ``.metadata``, index or random-state file too;
* checkpoints without checksums or flat entries (the earlier format) still load, and the torch
  format's ``.crc32.json`` sidecar is checked before the file is unpickled.
"""
import io
import json
import math
import os
import shutil
from dataclasses import replace

import pytest
import torch

from megalite.checkpointing import CheckpointError, load_checkpoint, save_checkpoint
from megalite.checkpointing.layout import flat_boxes
from megalite.checkpointing.safe_load import SafeFileSystemReader
from megalite.checkpointing.sharded import ItemFiles, read_index
from megalite.checkpointing.sharded_read import read_whole
from megalite.parallel_state import ParallelState
from megalite.testing import run_distributed
from megalite.training import Trainer
from megalite.training.mock import MockFeed
from tests.distributed.common import GPT2_STYLE, tiny_config


def _cfg(tp=1, pp=1, distopt=False, dtype="float32"):
    cfg = tiny_config(GPT2_STYLE, gbs=4, mbs=1, num_layers=4, tp=tp, pp=pp)
    return cfg.with_(model=replace(cfg.model, params_dtype=dtype),
                     optim=replace(cfg.optim, use_distributed_optimizer=distopt))


def _parts(t):
    return t.cfg, t.ps, t.chunks, t.optimizer, t.scheduler, t.state, t.tracker


def _state(t):
    """Every weight and the whole optimizer state (collective over DP)."""
    return {"model": {n: p.detach().clone() for c in t.chunks for n, p in c.named_parameters()},
            "optim": t.optimizer.full_state_dict(include_main=True, to_cpu=True)}


def _save_trained(ps, cfg, root):
    t = Trainer(cfg, ps)
    t.train_step(MockFeed(t, 1).next())  # Adam's moments exist
    t.state.iteration = 1
    save_checkpoint(*_parts(t), root, "sharded")
    state = _state(t)
    buf = io.BytesIO()  # plain bytes: tensors through the result queue would outlive their rank
    torch.save(state, buf)
    return buf.getvalue() if ps.tp_size == ps.pp_size == 1 and ps.rank == 0 else None


def _load_resave(ps, cfg, src, dst):
    t = Trainer(cfg, ps)
    assert load_checkpoint(*_parts(t), src) == 1
    save_checkpoint(*_parts(t), dst, "sharded")
    return True


def _loaded(root, cfg):
    t = Trainer(cfg, ParallelState.single())
    assert load_checkpoint(*_parts(t), root) == 1
    return _state(t)


def _assert_equal(a, b, what):
    for part in ("model", "optim"):
        assert a[part].keys() == b[part].keys(), what
        for n in a[part]:
            x, y = a[part][n], b[part][n]
            if isinstance(x, dict):
                assert x.keys() == y.keys(), (what, n)
                for k in x:
                    assert torch.equal(torch.as_tensor(x[k]), torch.as_tensor(y[k])), (what, n, k)
            else:
                assert torch.equal(x, y), (what, n)


def _index(root):
    d = os.path.join(root, "iter_0000001")
    return [e for fn in sorted(os.listdir(d)) if fn.startswith("index_")
            for e in json.load(open(os.path.join(d, fn)))]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_flat_entries_load_into_other_dp_tp_pp(tmp_path):
    dp4, dp2 = str(tmp_path / "dp4"), str(tmp_path / "tp2dp2")
    saved = torch.load(io.BytesIO(run_distributed(_save_trained, 4, _cfg(distopt=True), dp4)[0]))
    run_distributed(_save_trained, 4, _cfg(tp=2, distopt=True, dtype="bfloat16"), dp2, tp=2)
    assert all("flat" in e and "crc32" in e for e in _index(dp4) if e["prefix"].startswith("optim"))
    assert any("flat" in e for e in _index(dp2))
    single = _loaded(dp4, _cfg())
    _assert_equal(single, saved, "dp4 -> dp1")
    d = os.path.join(dp4, "iter_0000001")  # whole tensors from flat pieces, as the converter reads them
    whole = read_whole(d, read_index(d), list(saved["model"]))
    for n, t in whole.items():  # vocabulary tables: the real rows (padding is never saved)
        assert torch.equal(t, saved["model"][n][:t.shape[0]]), n
    for name, world, tp, pp, cfg in [("dp2", 2, 1, 1, _cfg(distopt=True)), ("tp2pp2", 4, 2, 2, _cfg(tp=2, pp=2))]:
        out = str(tmp_path / f"dp4-{name}")
        run_distributed(_load_resave, world, cfg, dp4, out, tp=tp, pp=pp)
        _assert_equal(_loaded(out, _cfg()), saved, f"dp4 -> {name} -> dp1")
    half = _loaded(dp2, _cfg(dtype="bfloat16"))  # bf16: the fp32 main weights come from optim.param
    out = str(tmp_path / "tp2dp2-dp4")
    run_distributed(_load_resave, 4, _cfg(distopt=True, dtype="bfloat16"), dp2, out)
    _assert_equal(_loaded(out, _cfg(dtype="bfloat16")), half, "tp2 dp2 -> dp4 -> dp1")


# -- damaged files (one process) -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt") / "src")
    state = torch.load(io.BytesIO(_save_trained(ParallelState.single(), _cfg(), root)))
    return root, state


def _copy(saved_root, tmp_path):
    root = str(tmp_path / "copy")
    shutil.copytree(saved_root[0], root)
    return root, os.path.join(root, "iter_0000001")


def _refused(root, match):
    with pytest.raises(CheckpointError, match=match) as e:
        _loaded(root, _cfg())
    assert "\n" not in str(e.value)
    return str(e.value)


def _largest_item(d):
    files = ItemFiles(d, SafeFileSystemReader(d).read_metadata())
    try:
        key = max(files.where, key=lambda k: files.where[k].length)
        size = math.prod(files.meta[key].size) * 4
        _, path, offset, _ = files.locate(key, size)
        return path, offset, size
    finally:
        files.close()


def _flip(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("checksums", [True, False], ids=["index-crc32", "earlier-format"])
def test_flipped_byte_in_a_shard_is_named(saved_root, tmp_path, checksums):
    root, d = _copy(saved_root, tmp_path)
    if not checksums:  # the earlier format: no crc32 in the index; the zip record's CRC-32 still guards it
        for fn in os.listdir(d):
            if fn.startswith("index_"):
                p = os.path.join(d, fn)
                entries = [{k: v for k, v in e.items() if k != "crc32"} for e in json.load(open(p))]
                json.dump(entries, open(p, "w"))
        _assert_equal(_loaded(root, _cfg()), saved_root[1], "without checksums")
    path, offset, size = _largest_item(d)
    _flip(path, offset + size // 2)
    msg = _refused(root, r"__0_0\.distcp: .* fails its checksum .*--ckpt-step")
    assert path in msg


def test_shifted_offsets_in_an_index_are_named(saved_root, tmp_path):
    root, d = _copy(saved_root, tmp_path)
    p = os.path.join(d, "index_00000.json")
    entries = json.load(open(p))
    e = next(e for e in entries if e["offsets"][0] + e["sizes"][0] < e["shape"][0])  # a piece of fused QKV
    e["offsets"] = [e["offsets"][0] + 1] + e["offsets"][1:]
    json.dump(entries, open(p, "w"))
    _refused(root, r"index_00000\.json: entry .* does not match its offsets")


@pytest.mark.parametrize("target", ["__0_0.distcp", ".metadata", "index_00000.json", "rng_00000.pt"])
@pytest.mark.parametrize("damage", ["missing", "truncated", "zeroed"])
def test_missing_truncated_zeroed_files_are_one_line(saved_root, tmp_path, target, damage):
    root, d = _copy(saved_root, tmp_path)
    path = os.path.join(d, target)
    size = os.path.getsize(path)
    if damage == "missing":
        os.remove(path)
    else:
        with open(path, "r+b") as f:
            if damage == "truncated":
                f.truncate(size // 2)
            else:
                f.write(bytes(size))
    _refused(root, target.replace(".", r"\."))


def test_torch_format_sidecar_checksum(tmp_path):
    root = str(tmp_path)
    t = Trainer(_cfg(), ParallelState.single())
    t.state.iteration = 1
    save_checkpoint(*_parts(t), root, "torch")
    path = os.path.join(root, "iter_0000001", "mp_rank_00", "model_optim_rng.pt")
    assert os.path.exists(path + ".crc32.json")  # the writer keeps a checksum sidecar
    _loaded(root, _cfg())
    _flip(path, os.path.getsize(path) // 2)
    msg = _refused(root, r"model_optim_rng\.pt fails its checksum .*--ckpt-step")
    assert path in msg


def test_flat_boxes_cover_exactly_the_range():
    for sizes in [(7,), (4, 5), (3, 4, 5)]:
        n = math.prod(sizes)
        full = torch.arange(n).view(sizes)
        for lo, hi in [(0, n), (1, n - 1), (3, 4), (n // 2, n), (0, 1)]:
            got = []
            for off, sz, place in flat_boxes((2,) * len(sizes), sizes, lo, hi):
                assert place == len(got)
                got += full[tuple(slice(o - 2, o - 2 + s) for o, s in zip(off, sz))].reshape(-1).tolist()
            assert got == list(range(lo, hi)), (sizes, lo, hi)
