"""Megatron-Core's torch_dist format without megatron-core: megalite's own torch_dist files through the
converter (in a fresh interpreter), the messages that name the format, and pickled code in either of its
pickles refused without running. (Against megatron-core itself: tests/distributed/test_torch_dist.py.)
"""

from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch

from megalite.checkpointing import save_checkpoint
from megalite.checkpointing.safe_load import CheckpointError
from megalite.interop.native_io import MegaliteSource
from tests.helpers.convert import _convert, convert, make_trainer, parts

PWNED = "/tmp/megalite_torch_dist_pwned"


class _Boom:
    def __reduce__(self):
        return (os.system, (f"touch {PWNED}",))


@pytest.mark.slow  # ~20 s: a converter subprocess per case
def test_torch_dist_bad_inputs_name_the_format(tmp_path):
    """No megatron-core needed: our own torch_dist files, the messages that name the format, and
    pickled code in either of its pickles refused without running."""
    t = make_trainer("llama")
    save_checkpoint(parts(t), str(tmp_path / "ml"))
    p = _convert(
        "--loader",
        "megalite",
        "--saver",
        "megatron",
        "--target-format",
        "torch_dist",
        "--load-dir",
        tmp_path / "ml",
        "--save-dir",
        tmp_path / "td",
    )
    assert p.returncode == 0, p.stderr
    td = tmp_path / "td" / "iter_0000000"
    # megalite's loader (converter and inference) sends the user to the one that reads it
    with pytest.raises(CheckpointError, match="torch_dist checkpoint.*--loader megatron"):
        MegaliteSource(str(tmp_path / "td"))
    # --target-format torch_dist belongs to --saver megatron: one line, nothing written
    assert convert("megalite", "megalite", tmp_path / "ml", tmp_path / "x", "--target-format", "torch_dist") == 1
    assert not (tmp_path / "x").exists()
    for victim in ("common.pt", ".metadata"):
        broken = tmp_path / f"broken_{victim}"
        shutil.copytree(tmp_path / "td", broken)
        path = broken / "iter_0000000" / victim
        if victim == "common.pt":
            sd = torch.load(path, weights_only=False)
            sd["args"].evil = _Boom()
            torch.save(sd, path)
        else:
            md = pickle.loads(path.read_bytes())
            md.planner_data = _Boom()
            path.write_bytes(pickle.dumps(md))
        p = _convert("--loader", "megatron", "--saver", "megalite", "--load-dir", broken, "--save-dir", tmp_path / "x")
        assert p.returncode != 0 and "refusing" in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert not os.path.exists(PWNED) and not (tmp_path / "x").exists()
    assert td.is_dir()
