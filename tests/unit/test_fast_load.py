"""The sharded load in one process: flipped bytes in a shard and shifted offsets in an index are refused with
one line naming the file; a missing, truncated or zeroed shard, ``.metadata``, index or random-state file too;
checkpoints without checksums (the earlier format) still load, and the torch format's ``.crc32.json`` sidecar
is checked before the file is unpickled. (Flat entries loaded into other layouts: tests/distributed.)
"""

import io
import json
import math
import os
import shutil

import pytest
import torch

from megalite.checkpointing import CheckpointError, save_checkpoint
from megalite.checkpointing.layout import flat_boxes
from megalite.checkpointing.safe_load import SafeFileSystemReader
from megalite.checkpointing.sharded import ItemFiles
from megalite.parallel.state import ParallelState
from megalite.training import Trainer
from tests.helpers.fast_load import _assert_equal, _cfg, _loaded, _parts, _save_trained


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
    save_checkpoint(_parts(t), root, "torch")
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
