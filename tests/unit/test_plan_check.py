"""The planner checks itself: --plan-check's refusal, the predicted-beside-measured block, the
calibrated step time (tools/plan.py --calibrate), context parallelism in the memory model."""

from __future__ import annotations

import json
import re

import pytest

from megalite.analysis.calibrate import Calibration, MeasuredRun
from megalite.analysis.plan_check import FREE_ENV, layout_of, refusal
from megalite.analysis.planner import GiB, Layout, estimate_memory, layer_activation_bytes, memory_per_rank
from megalite.analysis.simulate import simulate_schedule
from megalite.config import ModelConfig
from megalite.config.settings import resolve_settings
from tests.helpers import TINY_RUN

MODEL = dict(
    num_layers=8,
    hidden_size=256,
    num_attention_heads=8,
    seq_length=512,
    vocab_size=4096,
    params_dtype="bfloat16",
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
PLAN_RUN = [
    "--mock-data",
    "--vocab-size",
    "4096",
    "--num-layers",
    "8",
    "--hidden-size",
    "256",
    "--num-attention-heads",
    "8",
    "--seq-length",
    "512",
    "--max-position-embeddings",
    "512",
    "--micro-batch-size",
    "8",
    "--global-batch-size",
    "16",
    "--bf16",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--train-iters",
    "1",
    "--eval-iters",
    "0",
    "--num-threads",
    "1",
]


def _parse(argv):
    from megalite.config.arguments import parse_args

    return parse_args(argv)


def test_refusal_is_one_line_naming_the_nearest_layouts_that_fit():
    cfg = _parse(PLAN_RUN)
    layout = layout_of(cfg, resolve_settings(cfg, 1))
    assert layout == Layout(1, 1, 1, mbs=8)
    model = cfg.model
    need = estimate_memory(model, layout, 16).total
    small = estimate_memory(model, Layout(1, 1, 1, mbs=2, recompute="full"), 16).total
    free = small / 0.85 * 1.01  # mbs 2 with full recomputation fits in 85% of it; mbs 8 does not
    assert need > free
    line = refusal(cfg, layout, 0, free, "GPU 0 has", "cuda")
    assert "\n" not in line
    head = (
        f"--plan-check: tp1 pp1 vp1 dp1 mbs8 none needs an estimated {need / GiB:.1f} GiB on pipeline rank 0 (weights "
    )
    assert line.startswith(head), line
    assert f"but GPU 0 has {free / GiB:.1f} GiB free; nearest layouts that fit in {free * 0.85 / GiB:.1f} GiB: " in line
    suggested = re.findall(r"(tp\d+ pp\d+ vp\d+ dp\d+ mbs\d+ \w+[^(]*) \(([0-9.]+) GiB\)", line)
    assert suggested and all(float(g) <= free * 0.85 / GiB + 0.05 for _, g in suggested)
    assert all(s.startswith("tp1 pp1 vp1 dp1") for s, _ in suggested)  # one device: only batch and recompute move
    assert "--micro-batch-size" in line and line.endswith("; --no-plan-check to try anyway")
    assert refusal(cfg, layout, 0, need * 1.01, "GPU 0 has", "cuda") is None


def test_pretrain_refuses_before_building_the_model_with_a_fake_free_memory(monkeypatch, capsys):
    import pretrain_gpt

    monkeypatch.setenv(FREE_ENV, "0.01")
    assert pretrain_gpt.main(PLAN_RUN + ["--plan-check"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "pretrain_gpt.py: error: --plan-check: tp1 pp1 vp1 dp1 mbs8 none needs an estimated"
    ), err
    assert f"but {FREE_ENV}=0.01 0.0 GiB free" in err[0]


def test_plan_check_is_off_on_cpu_unless_asked_and_lets_a_fitting_layout_run(monkeypatch):
    import pretrain_gpt

    tiny = TINY_RUN + ["--train-iters", "1", "--eval-iters", "0", "--num-threads", "1"]
    monkeypatch.setenv(FREE_ENV, "0.001")  # 1 MiB: off on CPU unless asked
    assert pretrain_gpt.main(tiny) == 0
    assert pretrain_gpt.main(tiny + ["--plan-check", "--no-plan-check"]) == 0
    monkeypatch.setenv(FREE_ENV, "1000")  # fits: the run goes on
    assert pretrain_gpt.main(tiny + ["--plan-check"]) == 0


def test_run_prints_predicted_beside_measured_and_its_timeline_calibrates_plan_py(tmp_path, capsys):
    import pretrain_gpt
    from tools.plan import main as plan_main

    timeline = tmp_path / "t.json"
    run = TINY_RUN + [
        "--train-iters",
        "4",
        "--log-interval",
        "2",
        "--eval-iters",
        "0",
        "--num-threads",
        "1",
        "--plan-check",
        "--timeline-out",
        str(timeline),
    ]  # dropout on: the check draws no random number
    assert pretrain_gpt.main(run) == 0
    out = capsys.readouterr().out
    assert out.count("plan check after iteration 4:") == 1  # the first log iteration from the third on
    assert pretrain_gpt.main(run[:-3]) == 0  # the same run without the check trains the same
    assert re.findall(r"lm loss: (\S+)", capsys.readouterr().out) == re.findall(r"lm loss: (\S+)", out)
    mem = re.search(r"memory MiB, pp rank 0 +([0-9.]+) +([0-9.]+) +([+-][0-9.]+)%", out)
    assert mem and abs(float(mem.group(3))) < 2, out  # saved tensors and state counted term by term
    assert re.search(r"step time ms +[0-9.]+ +[0-9.]+ +[+-][0-9.]+%", out)
    meta = json.loads(timeline.read_text())
    assert (meta["tp"], meta["dp"], meta["mbs"], meta["pp"]) == (1, 1, 2, 1)
    assert set(meta["timers"]) == {"grads_sync", "optimizer", "step"}
    cfg = _parse(run)
    cal = Calibration.fit(cfg.model, [MeasuredRun.from_timeline(meta)])
    assert cal.predict(Layout(1, 1, 1, mbs=2), 8).step_s == pytest.approx(meta["timers"]["step"], rel=1e-6)
    m = cfg.model
    argv = [
        "--num-gpus",
        "2",
        "--gpu-memory",
        "1",
        "--num-layers",
        str(m.num_layers),
        "--hidden-size",
        str(m.hidden_size),
        "--num-attention-heads",
        str(m.num_attention_heads),
        "--vocab-size",
        "200",
        "--global-batch-size",
        "8",
        "--seq-length",
        str(m.seq_length),
        "--calibrate",
        str(timeline),
        "--save-calibration",
        str(tmp_path / "c.json"),
    ]
    assert plan_main(argv) == 0
    assert "step times calibrated on" in capsys.readouterr().out
    assert plan_main(argv[:-4] + ["--calibrate", str(tmp_path / "c.json")]) == 0
    assert plan_main(argv[:4] + ["--num-layers", "3"] + argv[6:-2]) == 2
    assert "was measured with num_layers 2, the model here has 3" in capsys.readouterr().err


def _synthetic_timeline(cfg: ModelConfig, layout: Layout, gbs: int, costs: dict, opt: float, sync: float) -> dict:
    """What a run with these true per-token costs would record: the simulator's events, the step's timers."""
    cal = Calibration(cfg, {k: dict(v) for k, v in costs.items()}, 0.0, 0.0, 0.0, 0.0)
    m = layout.num_microbatches(gbs)
    res = simulate_schedule(
        layout.schedule(), layout.pp, layout.vp, m, stage_costs=cal.stage_costs(layout), mode="executor"
    )
    return {
        **res.to_timeline(),
        "tp": layout.tp,
        "dp": layout.dp,
        "mbs": layout.mbs,
        "sp": layout.sp,
        "timers": {"grads_sync": sync, "optimizer": opt, "step": res.makespan + sync + opt},
    }


def test_calibration_from_a_synthetic_timeline_reproduces_its_step_and_predicts_others():
    cfg = ModelConfig(**MODEL)
    per_token = 1e-6
    costs = {
        "F": {"layer": per_token, "head": 3 * per_token, "embedding": 0.1 * per_token, "tp_comm": 0.0},
        "B": {"layer": 2 * per_token, "head": 6 * per_token, "embedding": 0.2 * per_token, "tp_comm": 0.0},
        "W": {"layer": per_token, "head": 3 * per_token, "embedding": 0.1 * per_token, "tp_comm": 0.0},
    }
    measured = Layout(1, 4, 1)
    timeline = _synthetic_timeline(cfg, measured, 16, costs, opt=0.002, sync=0.001)
    cal = Calibration.fit(cfg, [MeasuredRun.from_timeline(json.loads(json.dumps(timeline)))])
    for piece in ("layer", "head"):
        assert cal.pieces["F"][piece] == pytest.approx(costs["F"][piece], rel=1e-3)
        assert cal.pieces["B"][piece] == pytest.approx(costs["B"][piece], rel=1e-3)
    assert cal.predict(measured, 16).step_s == pytest.approx(timeline["timers"]["step"], rel=1e-3)
    for other in (Layout(1, 2, 1), Layout(1, 4, 1, vp=2), Layout(1, 2, 1, mbs=2), Layout(1, 1, 1)):
        truth = _synthetic_timeline(cfg, other, 16, costs, opt=0.0, sync=0.0)["timers"]["step"]
        got = cal.predict(other, 16)
        assert got.schedule_s == pytest.approx(truth, rel=1e-3), other
    # the optimizer's time follows the parameters on the busiest rank
    assert cal.predict(Layout(1, 2, 1), 16).optimizer_s > cal.predict(measured, 16).optimizer_s


def test_context_parallel_memory_scales_one_over_cp():
    cfg = ModelConfig(**MODEL, normalization="RMSNorm", swiglu=True, position_embedding_type="rope")
    one = layer_activation_bytes(cfg, 1, False, 2)
    for cp in (2, 4):
        assert layer_activation_bytes(cfg, 1, False, 2, cp=cp) == pytest.approx(one / cp)
    unfused = ModelConfig(**{**MODEL, "attention_backend": "unfused"})
    assert layer_activation_bytes(unfused, 2, True, 1, cp=4) == pytest.approx(
        layer_activation_bytes(unfused, 2, True, 1) / 4
    )
    base = memory_per_rank(cfg, Layout(1, 2, 2, dist_opt=True), 16)
    split = memory_per_rank(cfg, Layout(1, 2, 2, dist_opt=True, cp=2), 16)
    for b, s in zip(base, split):
        assert s.activations == pytest.approx(b.activations / 2, rel=0.01)  # the RoPE tables do not split
        assert s.optimizer == pytest.approx(b.optimizer / 2) and s.weights == b.weights  # ZeRO-1 over dp x cp
    gathered = memory_per_rank(cfg, Layout(1, 2, 2, cp=2, cp_comm="all_gather"), 16)[0].activations
    assert gathered > memory_per_rank(cfg, Layout(1, 2, 2, cp=2), 16)[0].activations  # the gathered K/V
    assert Layout(1, 2, 2, cp=2).flags(8)[-2:] == ["--context-parallel-size", "2"]


def test_plan_searches_context_parallel_for_long_sequences():
    from megalite.analysis.search import plan

    cfg = ModelConfig(
        num_layers=8,
        hidden_size=1024,
        num_attention_heads=8,
        seq_length=32768,
        vocab_size=32000,
        params_dtype="bfloat16",
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    plans = plan(
        cfg, num_gpus=8, gpu_memory_gib=40, global_batch_size=8, cp_sizes=(1, 2, 4, 8), micro_batches=(1,), max_vp=1
    )
    assert plans and any(p.layout.cp > 1 for p in plans)
    assert all(p.memory.total <= 34 * GiB for p in plans)
