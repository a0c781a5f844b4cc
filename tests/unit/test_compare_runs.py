"""compare_runs in one process: captures read back, the execution order, the band, the first diverging
tensor named, and bad input as one line (the multi-rank layouts and the torchrun command are in
tests/distributed/test_compare_runs.py)."""

import os
import sys
from pathlib import Path

import pytest
import torch

from megalite.analysis.divergence import Capture, compare, load_capture, order_key
from megalite.config import ConfigError
from megalite.parallel.state import ParallelState
from megalite.testing.capture import capture_mock
from tests.helpers.moe_parity import moe_config
from tests.helpers.parity import GPT2_STYLE, tiny_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import compare_runs  # noqa: E402

FC1 = "decoder.layers.1.mlp.linear_fc1.weight"


@pytest.fixture(scope="module")
def captures(tmp_path_factory):
    """The tiny GPT's first iteration, as is and with layer 1's fc1 weight perturbed."""
    root = tmp_path_factory.mktemp("captures")
    cfg = tiny_config(GPT2_STYLE)
    losses = [
        capture_mock(ParallelState.single(), cfg, str(root / "a")),
        capture_mock(ParallelState.single(), cfg, str(root / "b"), (FC1, 1e-3)),
    ]
    return root, losses


def test_perturbed_weight_in_layer_1_is_named_first_and_layer_0_agrees(captures):
    root, losses = captures
    a, b = load_capture(str(root / "a")), load_capture(str(root / "b"))
    assert a.tensors[("activation", "loss")].item() == pytest.approx(losses[0])
    report = compare(a, b)
    first = report.first
    assert (first.kind, first.name, first.layer) == ("weight", FC1, "1")
    before = report.rows[: report.rows.index(first)]
    assert {r.layer for r in before} == {"embedding", "0", "1"} and not any(r.over for r in before)
    assert all(
        not r.over for r in report.rows if r.layer in ("embedding", "0") and r.kind != "grad" and r.kind != "act_grad"
    )
    computed = next(r for r in report.rows if r.over and r.kind == "activation")
    assert computed.name == "decoder.layers.1"  # the first output it changes: its own layer's
    assert report.verdict().startswith(f"first divergence: weight {FC1} (layer 1, forward): max abs diff ")
    assert (
        compare(a, a).verdict() == f"agree: all {len(report.rows)} tensors within the band "
        "(rtol 1e-04, atol 0e+00 (float32 band))"
    )


def test_capture_holds_every_tensor_once(captures):
    a = load_capture(str(captures[0] / "a"))
    kinds = {k for k, _ in a.tensors}
    assert kinds == {"weight", "activation", "act_grad", "grad"}
    assert a.tensors[("activation", "decoder.layers.0")].shape == (16, 8, 32)  # [s, global batch, h]
    assert a.tensors[("activation", "logits")].shape == (16, 8, 250)  # the real vocabulary, no padding
    assert a.tensors[("weight", "embedding.word_embeddings.weight")].shape == (250, 32)
    assert ("grad", "decoder.layers.1.mlp.linear_fc1.weight") in a.tensors


def test_read_path_exit_codes_and_one_line(captures, capsys):
    root = captures[0]
    assert compare_runs.main(["--read", str(root / "a"), str(root / "a"), "--quiet"]) == 0
    assert compare_runs.main(["--read", str(root / "a"), str(root / "b")]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("agree: all ")
    assert out[1].startswith("side A: tp 1 pp 1 dp 1, float32, 4 micro-batches")
    assert out[-1].startswith(f"first divergence: weight {FC1} (layer 1, forward)")
    assert any(line.split()[3:4] == [FC1] and line.endswith("over") for line in out)  # its table row
    # a looser band lets the perturbation through: every tensor within it
    assert compare_runs.main(["--read", str(root / "a"), str(root / "b"), "--quiet", "--rtol", "1"]) == 0


def test_execution_order():
    names = [
        ("act_grad", "decoder.layers.0"),
        ("grad", "decoder.layers.1.mlp.linear_fc1.weight"),
        ("activation", "loss"),
        ("weight", "decoder.layers.1.mlp.linear_fc1.weight"),
        ("activation", "decoder.layers.1"),
        ("act_grad", "logits"),
        ("activation", "embedding"),
        ("weight", "embedding.word_embeddings.weight"),
        ("act_grad", "decoder.layers.1"),
        ("grad", "embedding.word_embeddings.weight"),
        ("activation", "logits"),
        ("grad", "output_layer.weight"),
    ]
    ordered = sorted(names, key=lambda k: order_key(k[0], k[1], 0))
    assert ordered == [
        ("weight", "embedding.word_embeddings.weight"),
        ("activation", "embedding"),
        ("weight", "decoder.layers.1.mlp.linear_fc1.weight"),
        ("activation", "decoder.layers.1"),
        ("activation", "logits"),
        ("activation", "loss"),
        ("act_grad", "logits"),
        ("grad", "output_layer.weight"),
        ("act_grad", "decoder.layers.1"),
        ("grad", "decoder.layers.1.mlp.linear_fc1.weight"),
        ("act_grad", "decoder.layers.0"),
        ("grad", "embedding.word_embeddings.weight"),
    ]


def _capture(tensors, dtype="float32"):
    return Capture(tensors, {k: i for i, k in enumerate(tensors)}, {"dtype": dtype}, "mem")


def test_band_is_relative_to_the_layer_and_looser_for_bf16():
    w = torch.ones(4, 4)
    key_bias_noise = torch.full((4,), 1e-9)  # a gradient that is zero but for round-off
    a = _capture({("grad", "decoder.layers.0.w"): w, ("grad", "decoder.layers.0.b"): key_bias_noise})
    b = _capture({("grad", "decoder.layers.0.w"): w, ("grad", "decoder.layers.0.b"): -key_bias_noise})
    assert compare(a, b).first is None  # 2e-9 against the layer's gradients of size 1
    c = _capture({("grad", "decoder.layers.0.w"): w * (1 + 1e-3), ("grad", "decoder.layers.0.b"): key_bias_noise})
    assert compare(a, c).first.name == "decoder.layers.0.w"
    c16 = _capture(c.tensors, dtype="bfloat16")
    report = compare(a, c16)
    assert report.first is None and (report.band_dtype, report.rtol) == ("bfloat16", 5e-2)


@pytest.mark.parametrize(
    "band", [{"rtol": float("nan")}, {"atol": float("nan")}, {"rtol": -1e-4}, {"atol": float("inf")}]
)
def test_a_band_that_is_nan_infinite_or_negative_is_refused_from_python(band):
    a = _capture({("grad", "decoder.layers.0.w"): torch.ones(2)})
    b = _capture({("grad", "decoder.layers.0.w"): torch.full((2,), 5.0)})  # far apart: a nan band said "agree"
    ((name, value),) = band.items()
    with pytest.raises(ValueError, match=rf"^compare: {name} must be a finite number >= 0, got {value}$"):
        compare(a, b, **band)
    assert compare(a, b, **{name: 0.0}).first is not None


def test_nonfinite_missing_and_reshaped_tensors_are_over():
    nan = torch.tensor([1.0, float("nan")])
    a = _capture({("activation", "decoder.layers.0"): nan, ("activation", "decoder.layers.1"): torch.ones(2)})
    assert compare(a, a).first is None  # the same NaNs in the same places agree
    b = _capture({("activation", "decoder.layers.0"): torch.ones(2), ("activation", "decoder.layers.1"): torch.ones(3)})
    rows = compare(a, b).rows
    assert [r.note for r in rows] == ["inf/NaN in 1 element(s) of A, 0 of B", "shape [2] in A, [3] in B"]
    c = _capture({("activation", "decoder.layers.0"): nan})
    assert compare(a, c).rows[1].note == "only in A"


def test_incomplete_capture_and_bad_input_are_one_line(captures, tmp_path, capsys):
    root = captures[0]
    blob = torch.load(str(root / "a" / "rank_00000.pt"), weights_only=True)
    blob["meta"]["world"] = 2  # a rank's file lost
    os.makedirs(tmp_path / "lost")
    torch.save(blob, str(tmp_path / "lost" / "rank_00000.pt"))
    first_box = next(i for i, p in enumerate(blob["pieces"]) if p["kind"] == "activation")
    blob["meta"]["world"] = 1
    del blob["pieces"][first_box]  # one micro-batch's box of the embedding output lost
    os.makedirs(tmp_path / "box")
    torch.save(blob, str(tmp_path / "box" / "rank_00000.pt"))
    cases = [
        (
            ["--read", str(tmp_path / "lost"), str(root / "a")],
            f"{tmp_path / 'lost'}: the capture of 2 ranks lacks the files of rank(s) 1; capture this side again",
        ),
        (
            ["--read", str(tmp_path / "box"), str(root / "a")],
            f"{tmp_path / 'box'}: activation embedding lacks elements; the capture is "
            "incomplete (capture this side again)",
        ),
        (["--read", str(tmp_path / "none"), str(root / "a")], f"{tmp_path / 'none'}: no such capture directory"),
        (["--read", str(tmp_path), str(root / "a")], f"{tmp_path}: holds no rank_<N>.pt files"),
        (
            ["--read", str(root / "a"), str(root / "b"), "--a", "--bf16"],
            "--read compares captures written earlier; it takes no --a",
        ),
        (["--perturb", "fc1", "--", "--mock-data"], "--perturb 'fc1': give NAME=EPS"),
        (
            ["--b", "--hidden-size 33", "--", "--mock-data", "--num-attention-heads", "4"],
            "side B: --hidden-size 33 is not divisible by --num-attention-heads 4",
        ),
        (
            ["--b", "--use-torch-fsdp2", "--", "--mock-data"],
            "side B: --data-parallel-sharding-strategy optim_grads_params is not captured",
        ),
    ]
    for argv, expected in cases:
        assert compare_runs.main(argv) == 2, argv
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"compare_runs.py: error: {expected}"), (argv, err)


def test_perturbing_an_unknown_parameter_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="the model has no parameter named 'decoder.layers.9.x'"):
        capture_mock(ParallelState.single(), tiny_config(GPT2_STYLE), str(tmp_path), ("decoder.layers.9.x", 1.0))


EXPERT_FC1 = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"


def test_mixture_of_experts_captures_and_a_perturbed_expert_is_named_first(tmp_path):
    """Expert gradients live in their own buffer (over expert DP): the capture reads each parameter's
    main_grad from its own buffer (it once cut them out of the dense one: ``shape ... is invalid``)."""
    cfg = moe_config()
    capture_mock(ParallelState.single(), cfg, str(tmp_path / "a"))
    capture_mock(ParallelState.single(), cfg, str(tmp_path / "b"), (EXPERT_FC1, 1e-3))
    a, b = load_capture(str(tmp_path / "a")), load_capture(str(tmp_path / "b"))
    assert ("grad", EXPERT_FC1) in a.tensors and a.tensors[("grad", EXPERT_FC1)].abs().sum() > 0
    assert compare(a, a).first is None
    first = compare(a, b).first
    assert (first.kind, first.name, first.layer) == ("weight", EXPERT_FC1, "1")


@pytest.mark.parametrize(
    "flag,value,expected",
    [
        ("--rtol", "nan", "argument --rtol: must be a finite number, got nan"),
        ("--rtol", "inf", "argument --rtol: must be a finite number, got inf"),
        ("--rtol", "-1e-3", "argument --rtol: must be >= 0, got -1e-3"),
        ("--atol", "nan", "argument --atol: must be a finite number, got nan"),
        ("--timeout", "0", "argument --timeout: must be > 0, got 0"),
    ],
)
def test_band_and_timeout_must_be_finite_and_in_range(captures, capsys, flag, value, expected):
    """A nan band made every comparison False, so two different runs were reported to agree."""
    root = captures[0]
    assert compare_runs.main(["--read", str(root / "a"), str(root / "b"), f"{flag}={value}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"compare_runs.py: error: {expected}"]
