"""Checkpoints a run can trust, in one process (issue 21, item 6): a damaged ``latest`` file or
meta.json is one line naming the file (and the field), a full disk during a save is one line, the
``--save`` lock refuses a second run and takes over a stale one, and resuming with other
learning-rate settings is refused unless ``--override-opt_param-scheduler`` or
``--use-checkpoint-opt_param-scheduler`` says which win.
Non-shared ``--save`` directories across nodes: tests/distributed/test_ckpt_trust.py."""

import errno
import fcntl
import json
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

from megalite.checkpointing import CheckpointError
from megalite.checkpointing.save_lock import LOCK_FILE, acquire_save_lock, release_save_locks
from tests.helpers import REPO, TINY_RUN

RUN = TINY_RUN + ["--eval-iters", "0", "--num-threads", "1", "--lr-warmup-iters", "1", "--log-interval", "1"]
LATEST = "latest_checkpointed_iteration.txt"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint at iteration 2 (train-iters 4, exit at 2): what every case damages a copy of."""
    import pretrain_gpt

    root = tmp_path_factory.mktemp("trust") / "ck"
    assert pretrain_gpt.main(RUN + ["--train-iters", "4", "--exit-interval", "2", "--save", str(root)]) == 0
    release_save_locks()
    return root


def _copy(saved, tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(saved, dst)
    return dst


def _main(capsys, *args):
    import pretrain_gpt

    capsys.readouterr()
    rc = pretrain_gpt.main(RUN + ["--train-iters", "4", *args])
    out = capsys.readouterr()
    release_save_locks()
    return rc, out.out, out.err.strip().splitlines()


def _set_latest(content):
    def damage(ck):
        (ck / LATEST).unlink()
        if content is None:
            (ck / LATEST).mkdir()
        else:
            (ck / LATEST).write_bytes(content)

    return damage


def _edit_meta(edit):
    def damage(ck):
        path = ck / "iter_0000002" / "meta.json"
        meta = json.loads(path.read_text())
        path.write_text(json.dumps(edit(meta)))

    return damage


def _drop(*keys):
    def edit(meta):
        d = meta
        for k in keys[:-1]:
            d = d[k]
        del d[keys[-1]]
        return meta

    return edit


def _put(value, *keys):
    def edit(meta):
        d = meta
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value
        return meta

    return edit


# (case, damage, file named in the line, what else the line says); None: loads and trains on
DAMAGE = [
    ("latest binary", _set_latest(b"\x00\xff\xfe\x01"), LATEST, "found binary bytes b'\\x00\\xff\\xfe\\x01'"),
    ("latest Arabic-Indic digits", _set_latest("٢".encode()), LATEST, "ASCII digits"),
    ("latest empty", _set_latest(b""), LATEST, "the file is empty"),
    ("latest huge", _set_latest(b"2" * 100_000), LATEST, "65+ bytes"),
    ("latest negative", _set_latest(b"-2"), LATEST, "found '-2'"),
    ("latest a directory", _set_latest(None), LATEST, "is a directory"),
    ("latest Megatron release", _set_latest(b"release"), LATEST, "release checkpoint"),
    ("latest names a missing iteration", _set_latest(b"7"), "iter_0000007", "no meta.json"),
    ("latest with a newline", _set_latest(b"2\n"), None, None),
    ("meta not JSON", lambda ck: (ck / "iter_0000002" / "meta.json").write_text("{"), "meta.json", "damaged"),
    ("meta a list", _edit_meta(lambda m: [m]), "meta.json", "JSON list"),
    ("meta iteration missing", _edit_meta(_drop("iteration")), "meta.json", "field 'iteration' is missing"),
    ("meta iteration a string", _edit_meta(_put("2", "iteration")), "meta.json", "field 'iteration' has the wrong"),
    ("meta iteration a bool", _edit_meta(_put(True, "iteration")), "meta.json", "field 'iteration' has the wrong"),
    ("meta consumed_samples negative", _edit_meta(_put(-8, "consumed_samples")), "meta.json", "is negative"),
    ("meta scheduler missing", _edit_meta(_drop("scheduler")), "meta.json", "field 'scheduler' is missing"),
    (
        "meta scheduler.num_steps a float",
        _edit_meta(_put(2.5, "scheduler", "num_steps")),
        "meta.json",
        "'scheduler.num_steps'",
    ),
    ("meta scheduler.lr a string", _edit_meta(_put("1e-3", "scheduler", "lr")), "meta.json", "'scheduler.lr'"),
    ("meta layout missing", _edit_meta(_drop("layout")), "meta.json", "field 'layout' is missing"),
    ("meta layout.tp a string", _edit_meta(_put("1", "layout", "tp")), "meta.json", "'layout.tp'"),
    (
        "meta layout.stage_layers not ints",
        _edit_meta(_put(["a"], "layout", "stage_layers")),
        "meta.json",
        "'layout.stage_layers'",
    ),
    ("meta model_shape a list", _edit_meta(_put([], "model_shape")), "meta.json", "field 'model_shape' has"),
    ("meta scaler a number", _edit_meta(_put(3, "scaler")), "meta.json", "field 'scaler' has the wrong"),
    ("meta group_steps strings", _edit_meta(_put(["x"], "group_steps")), "meta.json", "'group_steps'"),
    ("meta format unknown", _edit_meta(_put("zip", "format")), "meta.json", "'format' is 'zip'"),
    ("meta optional counters missing", _edit_meta(lambda m: _drop("nan_iters")(_drop("skipped_iters")(m))), None, None),
]


@pytest.mark.parametrize("case,damage,named,says", DAMAGE, ids=[c[0] for c in DAMAGE])
def test_damaged_checkpoint_is_one_line_naming_the_file(saved, tmp_path, capsys, case, damage, named, says):
    ck = _copy(saved, tmp_path)
    damage(ck)
    rc, out, err = _main(capsys, "--load", str(ck))
    if named is None:  # a correct load that trains on
        assert rc == 0 and "loaded checkpoint" in out and " iteration        4/       4" in out, err
        return
    assert rc == 2 and len(err) == 1 and err[0].startswith("pretrain_gpt.py: error: "), err
    assert named in err[0] and says in err[0], err[0]


def test_full_disk_during_a_save_is_one_line_and_keeps_latest(saved, tmp_path, capsys, monkeypatch):
    from megalite.checkpointing import protocol

    ck = _copy(saved, tmp_path)

    def full(root, it):
        raise OSError(errno.ENOSPC, "No space left on device", os.path.join(root, LATEST + ".tmp"))

    monkeypatch.setattr(protocol, "_write_latest", full)
    rc, _, err = _main(capsys, "--load", str(ck), "--save", str(ck))
    assert rc == 1 and len(err) == 1, err
    assert f"cannot publish the checkpoint of iteration 4 in {ck}: No space left on device" in err[0], err[0]
    assert (ck / LATEST).read_text() == "2"
    # a path in the way of the temporary directory is an OSError of begin_save: one line too
    monkeypatch.undo()
    (ck / "iter_0000004.tmp").write_text("in the way")
    rc, _, err = _main(capsys, "--load", str(ck), "--save", str(ck))
    assert rc == 1 and len(err) == 1 and "cannot start the checkpoint of iteration 4" in err[0], err
    assert (ck / LATEST).read_text() == "2"


HOLDER = """
import fcntl, json, os, socket, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": "then",
                         "run_id": sys.argv[2] or None}).encode())
print("locked", flush=True)
time.sleep(60)
"""


def _holder(path, run_id=""):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), run_id], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_run_saving_into_the_same_directory_is_refused(saved, tmp_path, capsys):
    ck = _copy(saved, tmp_path)
    holder = _holder(ck / LOCK_FILE)
    try:
        rc, _, err = _main(capsys, "--load", str(ck), "--save", str(ck))
        assert rc == 2 and len(err) == 1, err
        assert f"--save {ck} is in use by another run (host {socket.gethostname()}, pid {holder.pid}," in err[0]
        assert (ck / LATEST).read_text() == "2"
        rc, _, err = _main(capsys, "--save", str(ck))  # no --load: refused at start too, nothing written
        assert rc == 2 and len(err) == 1 and f"pid {holder.pid}" in err[0], err
        assert not (ck / "iter_0000004").exists() and (ck / LATEST).read_text() == "2"
    finally:
        holder.kill()
        holder.wait()
    # the holder died without removing the file: the lock is stale and taken over, with a warning
    rc, out, err = _main(capsys, "--load", str(ck), "--save", str(ck))
    assert rc == 0 and (ck / LATEST).read_text() == "4", err
    assert f"taking over the lock {ck / LOCK_FILE} of host {socket.gethostname()}, pid {holder.pid}" in out


def test_lock_rules(tmp_path, monkeypatch):
    # a stale lock on a file system without flock: same host, the pid gone
    root = tmp_path / "a"
    root.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (root / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started": "x"}))
    monkeypatch.setattr(fcntl, "flock", lambda fd, op: (_ for _ in ()).throw(OSError(errno.ENOLCK, "no locks")))
    acquire_save_lock(str(root))
    assert json.loads((root / LOCK_FILE).read_text())["pid"] == os.getpid()
    release_save_locks()
    assert not (root / LOCK_FILE).exists()  # released: the file is gone
    # ... but another host's lock cannot be judged there: refused
    (root / LOCK_FILE).write_text(json.dumps({"host": "elsewhere", "pid": dead.pid, "started": "x"}))
    with pytest.raises(CheckpointError, match=f"host elsewhere, pid {dead.pid}"):
        acquire_save_lock(str(root))
    monkeypatch.undo()
    # torchrun --max-restarts: a live holder is never taken over, not even by the same job id (two
    # launches without a distinct --rdzv-id share one); the next round finds the old round's lock free
    holder = _holder(root / LOCK_FILE, run_id="job7")
    try:
        for job in ("job8", "job7"):
            monkeypatch.setenv("TORCHELASTIC_RUN_ID", job)
            with pytest.raises(CheckpointError, match=f"pid {holder.pid}"):
                acquire_save_lock(str(root))
        holder.kill()
        holder.wait()
        acquire_save_lock(str(root))  # the previous round is gone: its lock is free
        assert json.loads((root / LOCK_FILE).read_text())["run_id"] == "job7"
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        release_save_locks()


EXITS = """
import os, signal, sys
from megalite.checkpointing.save_lock import acquire_save_lock
acquire_save_lock(sys.argv[1])
if os.fork() == 0:  # a run killed by a signal (no exit handlers run)
    acquire_save_lock(sys.argv[2])
    os.kill(os.getpid(), signal.SIGKILL)
os.wait()
"""  # then the parent exits normally


@pytest.mark.slow  # a Python that imports torch
def test_the_lock_is_released_at_exit_and_free_after_a_kill(tmp_path):
    done, killed = tmp_path / "done", tmp_path / "killed"
    subprocess.run([sys.executable, "-c", EXITS, str(done), str(killed)], cwd=REPO, check=True)
    assert not (done / LOCK_FILE).exists()  # removed at the normal exit
    assert (killed / LOCK_FILE).exists()  # a killed process leaves it behind: free all the same
    acquire_save_lock(str(killed))
    release_save_locks()


def _lr(out):
    return [float(x) for x in re.findall(r"learning rate: ([0-9.E+-]+) \|", out)]


def test_changed_learning_rate_settings_are_refused_unless_a_flag_says_which_win(saved, tmp_path, capsys):
    ck = str(_copy(saved, tmp_path))
    rc, out, err = _main(capsys, "--load", ck)
    assert rc == 0
    same = _lr(out)  # iterations 3, 4 of the saved schedule
    rc, _, err = _main(capsys, "--load", ck, "--lr", "0.002", "--min-lr", "0.0001", "--lr-warmup-iters", "2")
    assert rc == 2 and err == [
        "pretrain_gpt.py: error: the learning-rate schedule differs from the checkpoint's: --lr 0.002 (given) vs "
        "0.001 (checkpoint); --lr-warmup-iters 2 (given) vs 1 (checkpoint); pass --override-opt_param-scheduler "
        "to use the values given or --use-checkpoint-opt_param-scheduler to keep the checkpoint's"
    ]
    rc, _, err = _main(capsys, "--load", ck, "--train-iters", "8")  # the decay length follows --train-iters
    assert rc == 2 and "--lr-decay-iters 8 (given, from --train-iters) vs 4 (checkpoint)" in err[0], err
    rc, out, _ = _main(capsys, "--load", ck, "--lr", "0.002", "--use-checkpoint-opt_param-scheduler")
    assert rc == 0 and _lr(out) == same
    rc, out, _ = _main(capsys, "--load", ck, "--lr", "0.002", "--min-lr", "0.0002", "--override-opt_param-scheduler")
    assert rc == 0 and _lr(out) == pytest.approx([2 * x for x in same], rel=1e-5)
    rc, _, err = _main(capsys, "--load", ck, "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler")
    assert rc == 2 and len(err) == 1 and "are exclusive; pass one" in err[0], err
    # a checkpoint saved before the settings were recorded (num_steps only) loads as it always did
    _edit_meta(_put({"num_steps": 2}, "scheduler"))(tmp_path / "ck")
    rc, out, _ = _main(capsys, "--load", ck, "--lr", "0.002", "--min-lr", "0.0002")
    assert rc == 0 and _lr(out) == pytest.approx([2 * x for x in same], rel=1e-5)
