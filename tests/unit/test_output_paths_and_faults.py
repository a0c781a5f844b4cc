"""Output paths probed before training and --inject-fault-* flags that could never fire, through the CLI.

Each case ends before the first iteration with exit 2 and one line naming the flag (issue 33):
a --profile-dir or --debug-dir naming a file used to train and then fail (or claim records were
written), and an unreachable fault used to be ignored, so a test of in-job restart passed untested.
"""

import pytest

import pretrain_gpt
from megalite.config import ConfigError
from megalite.config.arguments import parse_args
from tests.helpers.bad_inputs import MOCK, _argv

CASES = [
    (
        "--profile --profile-step-start 0 --profile-step-end 1 --profile-dir $T/afile",
        "--profile-dir $T/afile is a file",
    ),
    (
        "--profile --profile-step-start 0 --profile-step-end 1 --tensorboard-dir $T/d --profile-dir $T/afile/x",
        "--profile-dir $T/afile/x cannot be created",
    ),
    ("--profile --profile-step-start 0 --profile-step-end 1", "--profile-dir profile is a file"),
    ("--debug-dir $T/afile", "--debug-dir $T/afile is a file"),
    ("--record-memory-history --memory-snapshot-path $T", "--memory-snapshot-path $T is a directory"),
    ("--ckpt-step -1", "--ckpt-step must be >= 0, got -1"),
    ("--inject-fault-at-iteration 4", "--inject-fault-at-iteration 4 never comes: the run trains iterations 1 to 3"),
    ("--inject-fault-kind hang", "--inject-fault-kind needs --inject-fault-at-iteration K"),
    ("--inject-fault-rank 1", "--inject-fault-rank needs --inject-fault-at-iteration K"),
    (
        "--inject-fault-at-iteration 2 --inject-fault-kind skip-send",
        "--inject-fault-kind skip-send drops a pipeline send, but --pipeline-model-parallel-size is 1",
    ),
]


@pytest.fixture
def outdir(tmp_path):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "profile").write_text("x")  # in the way of the traces' default directory, ./profile
    return tmp_path


@pytest.mark.parametrize("extra,text", CASES, ids=[c[0][-40:] for c in CASES])
def test_refused_before_training_in_one_line(extra, text, outdir, capsys, monkeypatch):
    monkeypatch.chdir(outdir)  # a default ./profile or snapshot lands in the test's directory
    rc = pretrain_gpt.main(_argv(MOCK, extra, outdir))
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2
    assert len(err) == 1, err
    assert err[0].startswith("pretrain_gpt.py: error: ")
    assert text.replace("$T", str(outdir)) in err[0]


def test_faults_that_can_fire_are_accepted():
    for extra in ("--inject-fault-at-iteration 3", "--inject-fault-at-iteration 1 --inject-fault-kind hang"):
        parse_args(MOCK + extra.split(), world_size=1)
    parse_args(
        MOCK
        + "--inject-fault-at-iteration 2 --inject-fault-kind skip-send".split()
        + ["--pipeline-model-parallel-size", "2"],
        world_size=2,
    )
    with pytest.raises(ConfigError, match="--skip-train"):
        parse_args(MOCK + "--inject-fault-at-iteration 1 --skip-train --load x".split(), world_size=1)


def test_the_diagnosis_never_names_records_it_could_not_write(tmp_path, capfd):
    """A --debug-dir that went bad after the probe (a full disk, a file put there): the line says the
    record was not written instead of sending the user to files that do not exist."""
    from megalite.observability.flight_recorder import FlightRecorder
    from megalite.observability.hang_watch import HangWatch
    from megalite.parallel.state import ParallelState

    (tmp_path / "debug").write_text("x")
    watch = HangWatch(ParallelState(1, 0, create_groups=False), FlightRecorder(16), str(tmp_path / "debug"), 6.0)
    watch.diagnose("test", fatal=True)
    err = capfd.readouterr().err
    assert f"could not write its flight record to {tmp_path / 'debug'}" in err, err
    assert "flight records of the ranks that answered are in" not in err, err
