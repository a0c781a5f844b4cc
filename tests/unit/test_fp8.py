"""FP8 training (tensor_parallel/fp8.py): the scaling math against the formulas, FP8 linears against an
independent reference and against plain linears, the flags' one-line errors, a CPU training run and
an exact resume of delayed scaling's amax history."""

import pathlib
import re

import pytest
import torch

from megalite.config import ConfigError, ModelConfig
from megalite.config.arguments import parse_args
from megalite.config.validate_fp8 import check_fp8_device
from megalite.parallel.state import ParallelState
from megalite.tensor_parallel.fp8 import (
    Fp8Linear,
    Fp8Recipe,
    amax_of,
    check_scaled_mm,
    describe_fp8,
    fp8_linear,
    probe_scaled_mm,
    quantize,
    scale_from_amax,
)
from megalite.tensor_parallel.layers import ColumnParallelLinear, enable_fp8
from tests.helpers.fp8 import reference_fp8_linear
from tests.helpers.pretrain_cli import TINY, _losses

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_scale_saturation_and_formats_follow_the_formulas():
    t = torch.tensor([[0.5, -3.0, 2.0], [0.001, 1.5, -0.25]])
    amax = amax_of(t)
    assert amax.item() == 3.0 and amax_of(t, -1).flatten().tolist() == [3.0, 1.5]
    assert scale_from_amax(amax, E4M3).item() == pytest.approx(448.0 / 3.0)
    assert scale_from_amax(amax, E5M2, margin=2).item() == pytest.approx(57344.0 / 3.0 / 4.0)
    assert scale_from_amax(torch.tensor(0.0), E4M3).item() == 1.0  # an all-zero tensor: nothing to scale
    q = quantize(t, scale_from_amax(amax, E4M3), E4M3)
    assert q.dtype == E4M3 and q.float()[0, 1].item() == -448.0  # the amax lands on the format's max
    over = quantize(torch.tensor([1000.0, -1e6, 3.0]), torch.tensor(1.0), E4M3).float().tolist()
    assert over == [448.0, -448.0, 3.0]  # saturated, not NaN or inf
    # round trip error within half an ulp: 3 mantissa bits for e4m3, 2 for e5m2
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    for dtype, bits in ((E4M3, 3), (E5M2, 2)):
        s = scale_from_amax(amax_of(x), dtype)
        back = quantize(x, s, dtype).float() / s
        big = x.abs() > x.abs().max() / 64  # normal numbers of the scaled format
        assert ((back - x).abs()[big] / x.abs()[big]).max() <= 2.0 ** -(bits + 1) + 1e-7
    hybrid, e4m3 = Fp8Recipe("hybrid"), Fp8Recipe("e4m3")
    assert [hybrid.dtype(r) for r in ("input", "weight", "grad_output")] == [E4M3, E4M3, E5M2]
    assert {e4m3.dtype(r) for r in ("input", "weight", "grad_output")} == {E4M3}


@pytest.mark.parametrize("fp8_format", ["e4m3", "hybrid"])
def test_tensorwise_linear_matches_an_independent_reference(fp8_format):
    gen = torch.Generator().manual_seed(1)
    x, w, g = (torch.randn(*s, generator=gen) for s in ((24, 32), (16, 32), (24, 16)))
    fp8 = Fp8Linear(Fp8Recipe(fp8_format, "tensorwise"), ParallelState.single().tp, "column")
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_linear(xa, wa, None, fp8)
    y.backward(g)
    ref = reference_fp8_linear(x, w, g, E5M2 if fp8_format == "hybrid" else E4M3)
    for got, want in zip((y, xa.grad, wa.grad), ref):
        assert (got.double() - want).abs().max() / want.abs().max() < 1e-6
    plain = x @ w.t()
    assert 1e-3 < float((y.detach() - plain).abs().max() / plain.abs().max()) < 0.1  # FP8's rounding, and no more


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
def test_fp8_column_linear_in_bf16_is_close_to_plain_bf16(recipe):
    tp = ParallelState.single().tp
    fp8, plain = (ColumnParallelLinear(64, 48, tp, seed=2, dtype=torch.bfloat16) for _ in range(2))
    enable_fp8(fp8, Fp8Recipe("hybrid", recipe))
    x = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    outs = []
    for layer in (fp8, plain):
        xa = x.clone().requires_grad_()
        y = layer(xa)
        y.float().square().sum().backward()
        outs.append((y, xa.grad, layer.weight.grad, layer.bias.grad))
    assert outs[0][0].dtype == torch.bfloat16 and outs[0][2].dtype == torch.bfloat16
    for name, a, b in zip(("y", "dx", "dw", "db"), *outs):
        err = float((a.detach().float() - b.detach().float()).abs().max() / b.detach().float().abs().max())
        assert err < 0.15, f"{recipe}: {name} off by {err:.3f}"


def test_delayed_scaling_uses_the_history_and_records_only_with_grad():
    fp8 = Fp8Linear(Fp8Recipe("e4m3", "delayed", amax_history_len=3, amax_compute_algo="max"), None, "column")
    fp8.tp = ParallelState.single().tp
    t = torch.tensor([2.0, -1.0])
    assert fp8.tensor_scale("input", t, record=True).item() == pytest.approx(224.0)  # empty history: current
    assert fp8.tensor_scale("input", t * 4, record=True).item() == pytest.approx(224.0)  # last step's amax 2
    assert fp8.history[0].tolist() == [8.0, 2.0, 0.0]
    assert fp8.tensor_scale("input", t, record=False).item() == pytest.approx(56.0)  # max of history: 8
    assert fp8.history[0].tolist() == [8.0, 2.0, 0.0]  # no grad (evaluation, recompute's first pass)
    margin = Fp8Linear(Fp8Recipe("e4m3", "delayed", margin=1), fp8.tp, "row")
    assert margin.tensor_scale("weight", t, record=True).item() == pytest.approx(112.0)


FP8_BASE = ["--bf16", "--fp8-format", "hybrid"]


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--fp8-format", "hybrid"], r"--fp8-format needs --bf16"),
        (FP8_BASE + ["--fp8-recipe", "mxfp8"], r"--fp8-recipe mxfp8 is not implemented in megalite; use one of"),
        (
            FP8_BASE + ["--recompute-granularity", "full", "--recompute-method", "uniform"],
            r"--fp8-recipe delayed with --recompute-granularity full",
        ),
        (FP8_BASE + ["--first-last-layers-bf16"], r"cover all 2 layers: no layer is left in FP8"),
        (FP8_BASE + ["--fp8-amax-history-len", "0"], r"--fp8-amax-history-len must be >= 1"),
        (
            FP8_BASE + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb_h1"],
            r"--pipeline-schedule zb_h1 splits weight gradients from input gradients, which the FP8 linears do not",
        ),
    ],
)
def test_bad_fp8_flags_are_one_line_errors(extra, message):
    with pytest.raises(ConfigError, match=message) as e:
        parse_args(TINY + extra, world_size=2 if "--pipeline-model-parallel-size" in extra else 1)
    assert "\n" not in str(e.value)


def test_fp8_is_refused_on_a_gpu_older_than_ada(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    m = ModelConfig(fp8_format="hybrid", params_dtype="bfloat16")
    with pytest.raises(ConfigError, match=r"compute capability 8.9 or newer .* NVIDIA A100 has 8.0: drop --fp8"):
        check_fp8_device(m, torch.device("cuda", 0))
    check_fp8_device(m, torch.device("cpu"))  # CPU: emulated GEMMs, allowed
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_device(m, torch.device("cuda", 0))


def test_first_last_layers_stay_bf16():
    m = ModelConfig(num_layers=6, fp8_format="e4m3", first_last_layers_bf16=True, num_layers_at_end_in_bf16=2)
    assert [m.fp8_layer(i) for i in range(6)] == [False, True, True, True, False, False]
    assert not ModelConfig(num_layers=6).fp8_layer(3)
    line = describe_fp8(m, torch.device("cuda"))
    assert "--fp8-recipe delayed, amax history 1 (most_recent): the linears of layers 1-3 of 6" in line
    assert line.endswith("GEMMs torch._scaled_mm")


RUN = TINY + ["--bf16", "--eval-iters", "0", "--lr", "2e-2", "--min-lr", "1e-3"]


def test_fp8_training_on_cpu_tracks_bf16_and_its_loss_falls(capsys):
    import pretrain_gpt

    assert pretrain_gpt.main(RUN + ["--train-iters", "10"]) == 0
    bf16 = _losses(capsys.readouterr().out)
    assert pretrain_gpt.main(RUN + ["--train-iters", "10", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]) == 0
    out = capsys.readouterr().out
    fp8 = _losses(out)
    assert "fp8: --fp8-format hybrid, --fp8-recipe tensorwise: the linears of layers 0-1 of 2 in FP8" in out
    assert "GEMMs emulated on cpu" in out  # the start line says how the GEMMs run here
    assert len(fp8) == 10 and fp8 != bf16  # the GEMMs did change
    assert sum(fp8[-3:]) / 3 < sum(fp8[:3]) / 3 - 0.05  # mock data's progressions are learnable
    assert all(abs(a - b) / b < 0.01 for a, b in zip(fp8, bf16))


@pytest.mark.parametrize("fmt", ["sharded", "torch"])
def test_delayed_scaling_resumes_exactly(fmt, tmp_path, capsys):
    import pretrain_gpt

    common = RUN + ["--fp8-format", "hybrid", "--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max"]
    common += ["--train-iters", "4", "--ckpt-format", fmt]
    ck = str(tmp_path / "ck")
    assert pretrain_gpt.main(common) == 0
    straight = _losses(capsys.readouterr().out)
    assert pretrain_gpt.main(common + ["--exit-interval", "2", "--save", ck, "--save-interval", "2"]) == 0
    first = _losses(capsys.readouterr().out)
    if fmt == "sharded":
        rng = torch.load(next(pathlib.Path(ck).glob("iter_0000002/rng_*.pt")), weights_only=True)
    else:
        rng = torch.load(next(pathlib.Path(ck).glob("iter_0000002/*/model_optim_rng.pt")), weights_only=True)
        rng = rng["rng_state"][0]
    assert len(rng["fp8"]) == 8 and all(h.shape == (3, 4) and h.gt(0).all() for h in rng["fp8"].values())
    assert pretrain_gpt.main(common + ["--load", ck]) == 0
    out = capsys.readouterr().out
    resumed = _losses(out)
    assert first + resumed == straight  # bit-exact: the amax histories came back
    assert "fp8: amax histories restored for all 8 FP8 linears" in out
    assert pretrain_gpt.main(common + ["--load", ck, "--no-load-rng"]) == 0  # model state: still restored
    assert _losses(capsys.readouterr().out) == resumed  # (dropout 0: the random states change nothing here)
    for f in pathlib.Path(ck).glob("iter_0000002/**/*.pt"):  # a checkpoint without histories: they start empty
        state = torch.load(f, weights_only=False)
        for rng in [state] if fmt == "sharded" and f.name.startswith("rng_") else state.get("rng_state", []):
            rng.pop("fp8", None)
        torch.save(state, f)
        f.with_name(f.name + ".crc32.json").unlink(missing_ok=True)  # rewritten: loads unchecked, as older files do
    assert pretrain_gpt.main(common + ["--load", ck]) == 0
    out = capsys.readouterr().out
    assert "fp8: amax histories restored for 0 of 8 FP8 linears (saved without them)" in out
    assert re.search(r"loaded checkpoint", out) and _losses(out) != resumed


def _through(layer_fn, x, w, g):
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = layer_fn(xa, wa)
    y.backward(g)
    return y.detach().float(), xa.grad.float(), wa.grad.float()


@pytest.mark.parametrize(
    "recipe,fp8_format,dtype", [("tensorwise", "hybrid", "float32"), ("rowwise", "e4m3", "bfloat16")]
)
def test_same_results_as_torchao_float8_linear(recipe, fp8_format, dtype):
    """A cross-check where torchao is installed (pip install torchao): its Float8Linear (the library
    torchtitan trains with) computes the same GEMMs; tensorwise in fp32, rowwise in bf16 (its home)."""
    ao = pytest.importorskip("torchao.float8")
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(5)
    x, w, g = (torch.randn(*s, generator=gen).to(dt) for s in ((32, 64), (48, 64), (32, 48)))
    ref = torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False)).to(dt)
    ao.convert_to_float8_training(ref, config=ao.Float8LinearConfig.from_recipe_name(recipe))

    fp8 = Fp8Linear(Fp8Recipe(fp8_format, recipe), ParallelState.single().tp, "column")
    mine = _through(lambda xa, wa: fp8_linear(xa, wa, None, fp8), x, w, g)
    xa = x.clone().requires_grad_()
    ref[0].weight = torch.nn.Parameter(w.clone())
    y = ref(xa)
    y.backward(g)
    for a, b in zip(mine, (y.detach().float(), xa.grad.float(), ref[0].weight.grad.float())):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_scaled_mm_on_cuda_matches_the_emulation(recipe, monkeypatch):
    """On an FP8 GPU the GEMMs run in torch._scaled_mm; they agree with the CPU emulation up to the
    order of fp32 accumulation and bf16 rounding of the result."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs compute capability 8.9 (FP8 tensor cores)")
    calls = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    gen = torch.Generator().manual_seed(6)
    x, w, g = (torch.randn(*s, generator=gen).bfloat16() for s in ((256, 512), (384, 512), (256, 384)))
    fp8 = Fp8Linear(Fp8Recipe("hybrid", recipe), ParallelState.single().tp, "column")
    cpu = _through(lambda xa, wa: fp8_linear(xa, wa, None, fp8), x, w, g)
    gpu = _through(lambda xa, wa: fp8_linear(xa, wa, None, fp8), x.cuda(), w.cuda(), g.cuda())
    assert len(calls) == 3  # forward, input gradient, weight gradient
    for a, b in zip(gpu, cpu):
        assert float((a.cpu() - b).abs().max() / b.abs().max()) < 1e-2


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_scaled_mm_probe_passes_torchs_kernel_and_names_a_wrong_or_failing_one(recipe, monkeypatch):
    """The start-of-run probe (on CUDA) decides whether a device's GEMMs go to torch._scaled_mm or are emulated;
    torch's CPU _scaled_mm stands in for the GPU's here."""
    r, cpu = Fp8Recipe("hybrid", recipe), torch.device("cpu")
    assert probe_scaled_mm(cpu, r) == ""  # torch's kernel agrees with the emulation
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: real(*a, **k) * 1.5)
    assert probe_scaled_mm(cpu, r) == "its float8_e4m3fn result differs from the emulation"

    def broken(*args, **kwargs):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul\nmore")

    monkeypatch.setattr(torch, "_scaled_mm", broken)
    assert probe_scaled_mm(cpu, r) == "it fails here: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul"
    assert check_scaled_mm(cpu, r) is None  # off CUDA nothing is probed: the GEMMs are emulated anyway


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise"])
@pytest.mark.parametrize("fp8_format", ["e4m3", "hybrid"])
def test_scaled_mm_runs_every_recipe_on_this_gpu(recipe, fp8_format):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability 8.9")
    assert probe_scaled_mm(torch.device("cuda"), Fp8Recipe(fp8_format, recipe)) == ""
