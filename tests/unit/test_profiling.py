"""--profile (torch.profiler traces of the asked ranks and iterations), --record-memory-history on CPU,
--wandb-* (offline run with the TensorBoard scalars), and their one-line errors."""

import json
import re
import time

import pytest

from megalite.config import ConfigError
from tests.helpers import TINY_RUN

TINY = TINY_RUN + ["--hidden-dropout", "0", "--attention-dropout", "0", "--lr-warmup-iters", "1", "--num-threads", "1"]


def _steps(trace_path):
    """The ProfilerStep#N spans of a Chrome trace (and checks that it is one)."""
    data = json.loads(trace_path.read_text())
    assert isinstance(data["traceEvents"], list) and data["traceEvents"]
    assert all({"name", "ph"} <= set(e) for e in data["traceEvents"])
    return sorted(
        {
            int(m.group(1))
            for e in data["traceEvents"]
            for m in [re.fullmatch(r"ProfilerStep#(\d+)", e.get("name", ""))]
            if m
        }
    )


def test_profile_traces_the_asked_iterations_only(tmp_path, capsys):
    import pretrain_gpt

    prof = tmp_path / "prof"
    rc = pretrain_gpt.main(
        TINY
        + [
            "--train-iters",
            "5",
            "--log-interval",
            "5",
            "--profile",
            "--use-pytorch-profiler",
            "--profile-step-start",
            "2",
            "--profile-step-end",
            "4",
            "--profile-dir",
            str(prof),
            "--record-memory-history",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert [p.name for p in prof.iterdir()] == ["rank0_iter3-4.pt.trace.json"]
    assert _steps(prof / "rank0_iter3-4.pt.trace.json") == [3, 4]  # Megatron's range: after 2, up to 4
    assert f"  profiler traces: {prof} (ranks 0, iterations 3-4)" in out
    # CPU: one warning, and the run went on (no snapshot written)
    assert out.count("--record-memory-history: the memory snapshot is CUDA-only; none on cpu") == 1
    assert "memory snapshot:" not in out


def _profiled_dp2(ps, tmp):
    from megalite.config.arguments import parse_args
    from megalite.data.mock_dataset import MockGPTDataset
    from megalite.training import Trainer

    cfg = parse_args(
        TINY
        + [
            "--train-iters",
            "3",
            "--log-interval",
            "3",
            "--profile",
            "--profile-ranks",
            "1",
            "--profile-step-start",
            "1",
            "--profile-step-end",
            "2",
            "--tensorboard-dir",
            tmp,
        ],
        world_size=ps.world_size,
    )
    trainer = Trainer(cfg, ps)
    trainer.train(MockGPTDataset(16, 200, cfg.train.seed, 3 * 8), None)


def test_profile_ranks_picks_the_ranks_and_defaults_to_the_tensorboard_dir(tmp_path, run_distributed):
    run_distributed(_profiled_dp2, 2, str(tmp_path))
    traces = sorted(p.name for p in tmp_path.glob("*.pt.trace.json"))
    assert traces == ["rank1_iter2-2.pt.trace.json"]
    assert _steps(tmp_path / traces[0]) == [2]


@pytest.mark.parametrize(
    "argv,world,message",
    [
        (
            ["--profile", "--profile-step-start", "12", "--profile-step-end", "12"],
            1,
            "--profile-step-end 12 must be above --profile-step-start 12: the traced iterations are start + 1 to end",
        ),
        (
            ["--profile", "--profile-ranks", "0", "4"],
            4,
            "--profile-ranks 4 is not a rank of this world of 4 (ranks 0 to 3)",
        ),
        (["--profile-step-start", "-1"], 1, "--profile-step-start must be >= 0, got -1"),
        (["--wandb-exp-name", "run1"], 1, "--wandb-exp-name and --wandb-save-dir need --wandb-project"),
        (["--straggler-threshold", "-1"], 1, "--straggler-threshold must be >= 0, got -1"),
        (["--straggler-threshold", "0.5"], 1, "--straggler-threshold 0.5 must be above 1: a rank is named at"),
        (["--straggler-threshold", "1"], 1, "--straggler-threshold 1 must be above 1"),
    ],
)
def test_bad_profiling_flags_are_one_line(argv, world, message):
    from megalite.config.arguments import parse_args

    with pytest.raises(ConfigError) as e:
        parse_args(TINY + argv, world_size=world)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_wandb_without_the_package_names_pip_install(monkeypatch, capsys):
    import importlib.util

    import pretrain_gpt

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert pretrain_gpt.main(TINY + ["--train-iters", "1", "--wandb-project", "p"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "pretrain_gpt.py: error: --wandb-project needs the wandb package: pip install wandb "
        "(or drop the --wandb-* flags)\n"
    )


def _wandb_history(path):
    """The history rows of an offline run's .wandb file (a leveldb log of protobuf records; wandb 0.31
    has no reader of its own): {step: {key: value}}, None until its exit record is written."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data, rows = path.read_bytes(), {}
    assert data[:4] == b":W&B"
    exited = False
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's trailer
            pos += 32768 - pos % 32768
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        buf, pos = buf + data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            exited = exited or record.WhichOneof("record_type") == "exit"
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows[record.history.step.num] = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items
                }
    return rows if exited else None


@pytest.mark.slow
def test_wandb_offline_run_gets_the_tensorboard_scalars(tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb")
    import pretrain_gpt

    for var in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc key: offline
    tb = tmp_path / "tb"
    rc = pretrain_gpt.main(
        TINY
        + [
            "--train-iters",
            "4",
            "--log-interval",
            "2",
            "--eval-interval",
            "4",
            "--eval-iters",
            "1",
            "--wandb-project",
            "megalite-test",
            "--wandb-exp-name",
            "tiny",
            "--wandb-save-dir",
            str(tmp_path / "wb"),
            "--tensorboard-dir",
            str(tb),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "wandb: no API key, logging offline to" in out
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    for _ in range(100):  # wandb's service may still be writing the file the run's finish() handed it
        rows = _wandb_history(next(runs[0].glob("run-*.wandb")))
        if rows is not None:
            break
        time.sleep(0.2)
    assert sorted(rows) == [2, 4]
    losses = [float(x) for x in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", out)]
    assert [rows[2]["lm loss"], rows[4]["lm loss"]] == pytest.approx(losses, rel=1e-6)
    # the same tags as TensorBoard's
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = ea.EventAccumulator(str(tb))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {k for row in rows.values() for k in row if not k.startswith("_")}
    assert "lm loss validation" in rows[4] and "iteration-time" in rows[2]
