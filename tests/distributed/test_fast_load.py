"""The sharded load: reading owner-written (flat) entries into any layout, checksums, damaged files.

* flat entries written at dp 2 and dp 4 with the distributed optimizer load into dp 1, 2, 4 and
  other tp/pp layouts, every weight and optimizer tensor equal to what was saved.

(Checksums and damaged files, in one process: tests/unit/test_fast_load.py.)
"""

import io
import json
import os

import pytest
import torch

from megalite.checkpointing import load_checkpoint, save_checkpoint
from megalite.checkpointing.sharded import read_index
from megalite.checkpointing.sharded_read import read_whole
from megalite.training import Trainer
from tests.helpers.fast_load import _assert_equal, _cfg, _loaded, _parts, _save_trained


def _load_resave(ps, cfg, src, dst):
    t = Trainer(cfg, ps)
    assert load_checkpoint(_parts(t), src) == 1
    save_checkpoint(_parts(t), dst, "sharded")
    return True


def _index(root):
    d = os.path.join(root, "iter_0000001")
    return [e for fn in sorted(os.listdir(d)) if fn.startswith("index_") for e in json.load(open(os.path.join(d, fn)))]


@pytest.mark.slow
def test_flat_entries_load_into_other_dp_tp_pp(tmp_path, run_distributed):
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
        assert torch.equal(t, saved["model"][n][: t.shape[0]]), n
    for name, world, tp, pp, cfg in [("dp2", 2, 1, 1, _cfg(distopt=True)), ("tp2pp2", 4, 2, 2, _cfg(tp=2, pp=2))]:
        out = str(tmp_path / f"dp4-{name}")
        run_distributed(_load_resave, world, cfg, dp4, out, tp=tp, pp=pp)
        _assert_equal(_loaded(out, _cfg()), saved, f"dp4 -> {name} -> dp1")
    half = _loaded(dp2, _cfg(dtype="bfloat16"))  # bf16: the fp32 main weights come from optim.param
    out = str(tmp_path / "tp2dp2-dp4")
    run_distributed(_load_resave, 4, _cfg(distopt=True, dtype="bfloat16"), dp2, out)
    _assert_equal(_loaded(out, _cfg(dtype="bfloat16")), half, "tp2 dp2 -> dp4 -> dp1")
