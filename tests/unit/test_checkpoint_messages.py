"""Checkpoint failures worded as what they are (issue 33, "messages that mislead"), through the CLI in
this process: a truncated ``.metadata`` is damage, not a matter of trust; a full disk under --async-save
says the disk is full, not torch's ``[enforce fail at inline_container.cc:672]``."""

import contextlib
import shutil

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_fs

import pretrain_gpt
from megalite.checkpointing.save_lock import release_save_locks
from tests.helpers import TINY_RUN

RUN = TINY_RUN + ["--eval-iters", "0", "--num-threads", "1", "--log-interval", "1", "--train-iters", "2"]


def _main(capsys, *args):
    capsys.readouterr()
    rc = pretrain_gpt.main(RUN + [str(a) for a in args])
    release_save_locks()
    return rc, capsys.readouterr().err.strip().splitlines()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("messages") / "ck"
    assert pretrain_gpt.main(RUN + ["--save", str(root)]) == 0
    release_save_locks()
    return root


@pytest.mark.parametrize("keep", [0.5, 0.0])
def test_a_truncated_index_is_damage_not_distrust(saved, tmp_path, capsys, keep):
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    index = ck / "iter_0000002" / ".metadata"
    index.write_bytes(index.read_bytes()[: int(index.stat().st_size * keep)])
    rc, err = _main(capsys, "--load", ck)
    assert rc == 2 and len(err) == 1, err
    assert f"{index} is damaged or truncated" in err[0] and "--ckpt-step" in err[0], err[0]
    assert "trust" not in err[0], err[0]


def _torch_save_error_on_a_full_disk() -> RuntimeError:
    """What torch.save raises when the disk fills under it (/dev/full: every write fails with ENOSPC)."""
    try:
        torch.save(torch.zeros(1000), "/dev/full")
    except RuntimeError as e:
        return e
    raise AssertionError("torch.save to /dev/full succeeded")


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_in_an_async_save_says_so(tmp_path, capsys, monkeypatch):
    error = _torch_save_error_on_a_full_disk()
    assert "inline_container.cc" in str(error)  # the words the user must not be left with
    real = dcp_fs.FileSystem.create_stream

    @contextlib.contextmanager
    def full_disk(self, path, mode):
        with real(self, path, mode) as stream:
            if str(path).endswith(".distcp"):  # the shard files: torch.save's writer fails as above
                raise error
            yield stream

    monkeypatch.setattr(dcp_fs.FileSystem, "create_stream", full_disk)
    rc, err = _main(capsys, "--save", tmp_path / "ck", "--async-save")
    assert rc == 1 and len(err) == 1, err
    assert "No space left on device" in err[0] and "inline_container" not in err[0], err[0]
    assert not (tmp_path / "ck" / "latest_checkpointed_iteration.txt").exists()


def test_a_megatron_torch_dist_moe_checkpoint_names_the_format_and_the_way_round(tmp_path, capsys):
    from tests.helpers.convert import FIXTURES

    ck = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "llama_torch_dist" / "ckpt", ck)
    common = ck / "iter_0000002" / "common.pt"
    state = torch.load(common, weights_only=False)
    state["args"].num_experts = 4  # what Megatron-LM records for an MoE model (its expert tensors aside)
    torch.save(state, common)
    capsys.readouterr()
    rc = pretrain_gpt.main(RUN + ["--load", str(ck), "--train-iters", "3"])  # refused before any shape check
    release_save_locks()
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "torch_dist checkpoint of an MoE model (num_experts 4)" in err[0], err[0]
    assert "--ckpt-convert-format torch" in err[0] and "tools/checkpoint/convert.py" in err[0], err[0]
    assert "megalite's model does not have" not in err[0], err[0]
