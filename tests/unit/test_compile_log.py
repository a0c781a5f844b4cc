"""--compile's flag and log lines: what was compiled, the first iteration's graphs and compile time, and
recompilations counted as they happen (the aot_eager backend: no C++ build)."""

import logging
import warnings
from dataclasses import replace

import pytest
import torch

from megalite.config.arguments import parse_args
from megalite.model import compile as compile_mod
from megalite.model.compile import CompileWatch, describe
from megalite.parallel.state import ParallelState
from tests.helpers.parity import tiny_config


@pytest.mark.parametrize("flag", ["--compile", "--torch-compile"])
def test_compile_flag_and_its_alias_set_one_field(flag):
    assert parse_args(["--mock-data", flag]).model.torch_compile
    assert not parse_args(["--mock-data"]).model.torch_compile


def test_recompilations_are_counted_as_they_happen(monkeypatch):
    torch._dynamo.reset()
    fn = torch.compile(lambda x: (x * 2).sin(), backend="aot_eager", dynamic=False)
    watch = CompileWatch()
    fn(torch.randn(4))
    first = watch.after_step(1)
    assert len(first) == 1 and first[0].startswith("compile: 1 graph compiled in iteration 1, "), first
    fn(torch.randn(4))
    assert watch.after_step(2) == []  # same shape: the graph is reused
    fn(torch.randn(5))  # another shape: a new graph
    assert watch.after_step(3) == ["compile: 1 graph recompiled in iteration 3 (1 since the first)"]
    fn(torch.randn(6))
    assert watch.after_step(4) == ["compile: 1 graph recompiled in iteration 4 (2 since the first)"]


def test_a_run_says_what_it_compiled_and_how_long_it_took(monkeypatch, caplog):
    monkeypatch.setattr(compile_mod, "BACKEND", "aot_eager")
    monkeypatch.setattr(logging.getLogger("megalite"), "propagate", True)
    caplog.set_level("INFO", logger="megalite")
    from megalite.data.mock_dataset import MockGPTDataset
    from megalite.training import Trainer

    torch._dynamo.reset()
    cfg = tiny_config(num_layers=2)
    train = replace(cfg.train, train_iters=2, eval_interval=1, eval_iters=1)
    cfg = cfg.with_(model=replace(cfg.model, torch_compile=True), train=train)
    Trainer(cfg, ParallelState.single()).train(MockGPTDataset(16, 250, 7, 16), MockGPTDataset(16, 250, 8, 64))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compile:")]
    assert said == [
        "compile: 2 transformer layers compiled regionally (aot_eager)",
        # both layers share one graph: regional compilation's cost does not grow with depth
        said[1],
        "compile: 1 graph compiled for the evaluation at iteration 1",  # its no-grad forward: not a recompilation
    ]  # and nothing recompiled in iteration 2 or its evaluation
    assert said[1].startswith("compile: 1 graph compiled in iteration 1, ") and " s of compile time " in said[1]


def test_the_start_line_names_what_runs_eagerly(monkeypatch):
    from megalite.model.compile import cannot_compile

    assert describe(2, 0, None, "selective") == (
        "compile: 2 transformer layers compiled regionally (inductor); the recomputed core attention runs eagerly"
    )
    assert describe(4, 2, None, "full", pipeline=True) == (
        "compile: 4 transformer layers of this pipeline rank compiled regionally (inductor); 2 MoE layers: "
        "attention, norms and "
        "residuals only (the MoE block runs eagerly); inside full recomputation"
    )
    monkeypatch.setattr(compile_mod, "_cpp_compiler", lambda: None)
    why = cannot_compile(torch.device("cpu"))
    assert describe(2, 0, why, None) == (
        "compile: skipped, 2 transformer layers run eagerly: inductor on CPU needs a C++ compiler "
        "(none found: set CXX or install g++)"
    )


def test_a_split_backward_schedule_refuses_compile_naming_the_flag():
    from megalite.config import ConfigError

    argv = ["--mock-data", "--compile", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb_h1"]
    with pytest.raises(ConfigError) as err:
        parse_args(argv + ["--num-layers", "4"], world_size=2)
    assert str(err.value) == (
        "--pipeline-schedule zb_h1 splits each backward into input and weight gradients, "
        "which torch.compile'd layers do not support; drop --compile (--torch-compile)"
    )


def test_compiled_layers_keep_their_names_and_are_freed_with_the_trainer(monkeypatch):
    """Compiling changes no parameter name, and a dropped compiled model frees its layers at once (no
    reference cycle through a compiled bound method, which nn.Module.compile would leave)."""
    import gc
    import weakref

    from megalite.model.gpt import GPTModel
    from megalite.tensor_parallel.random import RNGTracker
    from megalite.training.mock import train_mock

    monkeypatch.setattr(compile_mod, "BACKEND", "aot_eager")
    cfg = tiny_config(num_layers=2)
    cfg = cfg.with_(model=replace(cfg.model, torch_compile=True))
    ps = ParallelState.single()
    eager = GPTModel(replace(cfg.model, torch_compile=False), ps, RNGTracker(1, 0, 0, ps.device), seed=1)
    compiled = GPTModel(cfg.model, ps, RNGTracker(1, 0, 0, ps.device), seed=1)
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    gc.collect()
    gc.disable()
    try:
        trainer, _, _ = train_mock(cfg, ps, 1)
        layer_weight = weakref.ref(trainer.chunks[0].decoder.layers["1"].mlp.linear_fc1.weight)
        del trainer
        assert layer_weight() is None, "a compiled layer outlived its trainer (a reference cycle)"
    finally:
        gc.enable()


@pytest.mark.parametrize(
    "model,eager",
    [
        ({}, set()),
        ({"recompute_granularity": "selective"}, {"checkpoint"}),
        ({"attention_dropout": 0.1, "hidden_dropout": 0.1}, {"forked"}),
    ],
)
def test_a_layer_breaks_its_graph_only_where_it_runs_eagerly(model, eager):
    """A dense layer is one graph; selective recompute breaks it at the checkpoint only, attention dropout at
    the tracker's TP-stream switch only (dynamo's explain; a break nested in calls is reported once per
    calling frame, so reasons are counted by function)."""
    import re

    from megalite.model.gpt import GPTModel
    from megalite.tensor_parallel.random import RNGTracker

    cfg = replace(tiny_config().model, **model)
    ps = ParallelState.single()
    layer = GPTModel(cfg, ps, RNGTracker(1, 0, 0, ps.device), seed=1).decoder.layers["0"]
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer)(torch.randn(16, 2, 32, requires_grad=True))
    reasons = [str(b.reason) for b in explained.break_reasons]
    assert all("disable" in r for r in reasons), reasons  # at a marked eager region only
    assert {re.search(r"<function ([\w.]+) at", r).group(1).split(".")[-1] for r in reasons} == eager


def test_a_layer_that_cannot_be_compiled_runs_eagerly_with_a_warning(monkeypatch, caplog):
    """A compile failure (here a backend that raises) is one warning per layer, not an error: the layer runs
    eagerly from then on, with eager's results."""
    from megalite.model.gpt import GPTModel
    from megalite.tensor_parallel.random import RNGTracker

    def broken(graph, inputs):
        raise RuntimeError("no kernels today")

    monkeypatch.setattr(compile_mod, "BACKEND", broken)
    monkeypatch.setattr(compile_mod, "_CALLERS", {})
    monkeypatch.setattr(logging.getLogger("megalite"), "propagate", True)
    caplog.set_level("WARNING", logger="megalite")
    torch._dynamo.reset()
    cfg, ps = tiny_config().model, ParallelState.single()
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    logits = []
    for compiled in (False, True):
        model = GPTModel(replace(cfg, torch_compile=compiled), ps, RNGTracker(1, 0, 0, ps.device), seed=1)
        for _ in range(2):  # the second pass: the layers already run eagerly, nothing more is said
            logits.append(model(tokens).detach())
    assert all(torch.equal(logits[0], x) for x in logits[1:])
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and all(
        s.startswith(f"compile: layer {i} could not be compiled (BackendCompilerFailed: ")
        and s.endswith("; it runs eagerly from now on")
        for i, s in enumerate(said)
    ), said


def test_a_torch_that_guards_each_layer_gets_a_recompile_limit_for_every_layer(monkeypatch):
    """Without module inlining (torch < 2.5's default) each layer is its own graph: 24 layers must not hit
    dynamo's default limit of 8 and silently run eagerly."""
    import torch._dynamo.config as dynamo_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        monkeypatch.setattr(dynamo_config, "inline_inbuilt_nn_modules", False, raising=False)
    monkeypatch.setattr(dynamo_config, "cache_size_limit", 8)
    monkeypatch.setattr(compile_mod, "_layers_compiled", 0)
    for _ in range(24):
        compile_mod.compile_layer(torch.nn.Linear(2, 2))
    assert dynamo_config.cache_size_limit == 2 * 24 + 8
