"""Files written by Megatron-LM's own training code, converted as users do (the CLI in a fresh interpreter).

tests/fixtures/megatron_lm/ holds tiny checkpoints that Megatron-LM core_v0.16.1's
``save_checkpoint`` wrote (README.md there says how), in its legacy ``torch`` format and its
default ``torch_dist`` (one of them with its distributed optimizer's state after two training
iterations), with the logits its model gave on a fixed token sequence; tp2pp2_torch_dist.tar.xz holds two
tensor-2 x pipeline-2 runs saved in both of its optimizer sharding modes. Their ``args`` hold
signal.SIGTERM, AttnBackend and ModelType, their RNG state numpy arrays and dtypes: all must load, while a file carrying a pickled callable is refused
without running it, naming the callable.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megalite.checkpointing.safe_load import CheckpointError, MegatronValue, load_megatron_file, safe_torch_load
from megalite.inference import build_model, read_checkpoint
from megalite.interop import checkpoint_formats
from tests.helpers import REPO
from tests.helpers.convert import FIXTURES, _megatron_model_space_state, run_convert, unpack_tp2pp2


def in_fresh_interpreter(test):
    """Run ``test`` in a new interpreter: torch's safe-globals registry is process-wide, and megatron.core,
    which other tests import in this process, registers its enums and numpy types there on import."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        if os.environ.get("MEGALITE_FRESH_TEST") == test.__name__:
            return test(*args, **kwargs)
        done = subprocess.run(
            [sys.executable, "-m", "pytest", f"{Path(__file__)}::{test.__name__}", "-q", "-p", "no:cacheprovider"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "MEGALITE_FRESH_TEST": test.__name__},
        )
        assert done.returncode == 0, done.stdout[-3000:]

    return run


TOKENIZER = FIXTURES / "tokenizer"
# The GPT-2 fixture's args name its tokenizer files where they were when Megatron-LM saved it; here
# (any checkout) they are given as a user gives them for a checkpoint copied from another machine.
_GPT2_FILES = ["--vocab-file", TOKENIZER / "vocab.json", "--merge-file", TOKENIZER / "merges.txt"]
MOVED = {"gpt2": _GPT2_FILES, "llama": [], "gpt2_torch_dist": _GPT2_FILES, "llama_torch_dist": []}
SAVED_AT = {"gpt2": 1, "llama": 1, "gpt2_torch_dist": 1, "llama_torch_dist": 2}  # llama_torch_dist: 2 iterations


@pytest.mark.parametrize("style", ["gpt2", "llama", "gpt2_torch_dist", "llama_torch_dist"])
def test_megatron_lm_checkpoint_converts_with_its_logits(tmp_path, style):
    done = run_convert("megatron", "megalite", FIXTURES / style / "ckpt", tmp_path / "ml", *MOVED[style])
    assert done.returncode == 0, done.stderr
    assert ("torch_dist" in done.stdout) == style.endswith("torch_dist")  # the format was recognised as such
    ref = torch.load(FIXTURES / style / "logits.pt", weights_only=True)
    cfg, iteration, full = read_checkpoint(str(tmp_path / "ml"))
    assert iteration == SAVED_AT[style]
    with torch.no_grad():
        ours = build_model(cfg, full)(ref["tokens"][None]).transpose(0, 1)[0]  # [s, padded vocab]
    vocab = ref["vocab"]  # the tokenizer's whole vocabulary, eod included (llama: NullTokenizer 100 + eod)
    assert ref["eod"] == vocab - 1 and ref["eod"] in ref["tokens"]
    # Megatron's vocabulary as its tokenizer builds it (issue 22 item 3: NullTokenizer's eod row is N)
    assert cfg.model.vocab_size == vocab
    theirs = ref["logits"][:, :vocab]  # Megatron's padding rows hold random weights, ours zeros: not the model's
    assert theirs.abs().max() > 1.0
    assert (ours[:, :vocab] - theirs).abs().max() < 1e-4


# Megatron-LM's model flags of llama_torch_dist (make_fixture.py's COMMON and STYLES["llama"]), as pretrain_gpt.py takes
# them (NullTokenizer --vocab-size 100: 101 ids, eod = 100, in both).
LLAMA_RUN = [
    "--num-layers",
    "2",
    "--hidden-size",
    "16",
    "--num-attention-heads",
    "2",
    "--ffn-hidden-size",
    "24",
    "--seq-length",
    "16",
    "--max-position-embeddings",
    "16",
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--position-embedding-type",
    "rope",
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
    "--group-query-attention",
    "--num-query-groups",
    "1",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "1",
    "--lr",
    "1e-4",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "100",
    "--use-distributed-optimizer",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
]


def test_megatron_lm_torch_dist_run_resumes_with_its_distributed_optimizer_state(tmp_path):
    """pretrain_gpt.py --load on the directory Megatron-LM's training loop wrote after two iterations:
    weights, Adam's moments and step restored, then one more iteration trains."""
    ckpt = FIXTURES / "llama_torch_dist" / "ckpt"
    done = subprocess.run(
        [sys.executable, str(REPO / "pretrain_gpt.py"), *LLAMA_RUN, "--load", str(ckpt), "--train-iters", "3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stdout + done.stderr
    assert "(iteration 2): weights and distributed-optimizer state" in log, log[-3000:]
    assert "not restored (" not in log and "Adam starts fresh" not in log
    assert re.search(r" iteration +3/ +3 \| consumed samples: +3 \|", log), log[-3000:]
    assert "training done: 1 iterations (3 in all)" in log


def test_megatron_lm_distributed_optimizer_buckets_map_onto_its_weights():
    """The bucket layout megalite rebuilds for the real file: each parameter's fp32 main copy in the
    optimizer's buckets is the weight saved next to it (fp32 training), moments are there, step is 2."""
    from megalite.interop.torch_dist import TorchDistSource
    from megalite.interop.torch_dist_optim import read_distributed_optimizer

    src = TorchDistSource(str(FIXTURES / "llama_torch_dist" / "ckpt"))
    opt = read_distributed_optimizer(src)
    assert opt["step"] == 2.0
    weights = {
        **src.pre(),
        **src.post(),
        **{f"decoder.layers.{i}.{n}": t for i in range(src.cfg.num_layers) for n, t in src.layer(i).items()},
    }
    assert set(opt["state"]) == set(weights)
    for name, w in weights.items():
        got = opt["state"][name]
        assert torch.equal(got["param"], w.float()), name
        assert got["exp_avg_sq"].abs().max() > 0 and got["exp_avg"].abs().max() > 0, name


@in_fresh_interpreter
def test_megatron_lm_file_loads_its_plain_data_without_changing_torch_state():
    before = list(torch.serialization.get_safe_globals())
    torch.serialization.add_safe_globals([argparse.Namespace])  # someone else's registration stays as it was
    try:
        state = load_megatron_file(
            str(FIXTURES / "gpt2" / "ckpt" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt")
        )
        assert argparse.Namespace in torch.serialization.get_safe_globals()
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
    assert set(torch.serialization.get_safe_globals()) == set(before)
    args = state["args"]
    assert int(args.exit_signal) == 15 and args.params_dtype == torch.float32
    assert isinstance(args.attention_backend, MegatronValue) and isinstance(args.model_type, MegatronValue)
    assert args.model_type.megatron_class == "megatron.core.enums.ModelType"
    np_state = state["rng_state"][0]["np_rng_state"]
    assert np_state[0] == "MT19937" and np_state[1].dtype == np.uint32 and np_state[1].shape == (624,)


class _Payload:
    """Pickles as a call that would create ``marker`` when unpickled."""

    def __init__(self, how: str, marker: Path):
        self.how, self.marker = how, str(marker)

    def __reduce__(self):
        if self.how == "exec":
            return exec, (f"open({self.marker!r}, 'w').close()",)
        if self.how == "system":
            return os.system, (f"touch {self.marker}",)
        return shutil.copyfile, (os.devnull, self.marker)  # a plain function of the standard library


def _megatron_like(root: Path, value) -> Path:
    """A Megatron-LM torch-format checkpoint directory whose args carry ``value``."""
    d = root / "iter_0000001" / "mp_rank_00"
    d.mkdir(parents=True)
    args = argparse.Namespace(num_layers=1, hidden_size=8, num_attention_heads=2, payload=value)
    torch.save({"args": args, "iteration": 1, "model": {}}, d / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    return root


def test_pickled_callable_is_refused_by_the_converter_without_running(tmp_path):
    marker = tmp_path / "ran"
    src = _megatron_like(tmp_path / "evil", _Payload("exec", marker))
    done = run_convert("megatron", "megalite", src, tmp_path / "out")
    assert not marker.exists()
    assert done.returncode in (1, 2)  # convert.py's exit code for a refused checkpoint
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert "pickled object builtins.exec," in lines[0] and "model_optim_rng.pt" in lines[0]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize(
    "how,name",
    [("exec", "builtins.exec"), ("system", f"{os.system.__module__}.system"), ("function", "shutil.copyfile")],
)
def test_pickled_callable_is_refused_without_running(tmp_path, how, name):
    marker = tmp_path / "ran"
    src = _megatron_like(tmp_path / "evil", _Payload(how, marker))
    with pytest.raises(CheckpointError, match=f"pickled object {name},") as e:
        load_megatron_file(str(src / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"))
    assert "\n" not in str(e.value)
    # megalite's own (plain weights-only) reads refuse it too, naming the callable in full
    torch.save({"x": _Payload(how, marker)}, tmp_path / "plain.pt")
    with pytest.raises(CheckpointError, match=f"pickled object {name},"):
        safe_torch_load(str(tmp_path / "plain.pt"))
    assert not marker.exists()


def test_megatron_names_load_inert_never_imported(tmp_path, monkeypatch):
    """A megatron.* global (an enum in real files) becomes a MegatronValue: nothing is imported or called."""
    import types

    class Enumish:
        def __init__(self, v):
            raise AssertionError("the class itself must never be called when loading")

    Enumish.__module__, Enumish.__qualname__ = "megatron.fake_for_test", "Enumish"

    class Member:  # pickles as an enum member does: (class, (value,))
        def __reduce__(self):
            return Enumish, (3,)

    fake = types.ModuleType("megatron.fake_for_test")
    fake.Enumish = Enumish
    monkeypatch.setitem(sys.modules, "megatron.fake_for_test", fake)  # pickle checks the name when saving
    torch.save({"v": Member()}, tmp_path / "m.pt")
    monkeypatch.delitem(sys.modules, "megatron.fake_for_test")
    value = load_megatron_file(str(tmp_path / "m.pt"))["v"]
    assert isinstance(value, MegatronValue) and value.args == (3,)
    assert value.megatron_class == "megatron.fake_for_test.Enumish"
    assert "megatron.fake_for_test" not in sys.modules


@in_fresh_interpreter
def test_numpy_state_in_a_plain_load_names_the_class(tmp_path):
    """megalite's own files stay weights-only: numpy's RNG state there is refused with its full name."""
    torch.save({"np_rng_state": np.random.get_state()}, tmp_path / "f.pt")
    with pytest.raises(CheckpointError, match=r"pickled object numpy\.[\w.]+, outside") as e:
        safe_torch_load(str(tmp_path / "f.pt"))
    assert "\n" not in str(e.value)


def test_moved_checkpoint_without_its_tokenizer_files_keeps_every_row_and_says_so(tmp_path):
    """The args' vocab file is not at the stored path: all padded rows are kept (nothing lost), with a
    warning naming --true-vocab-size; --vocab-file gives the files where they are now."""
    src = FIXTURES / "gpt2" / "ckpt"
    gone = run_convert("megatron", "megalite", src, tmp_path / "a", "--vocab-file", tmp_path / "nope.json")
    assert gone.returncode == 0, gone.stderr
    assert "is not on this machine" in gone.stderr and "--true-vocab-size" in gone.stderr
    assert read_checkpoint(str(tmp_path / "a"))[0].model.vocab_size == 384  # the padded table, whole
    given = run_convert("megatron", "megalite", src, tmp_path / "b", *MOVED["gpt2"])
    assert given.returncode == 0, given.stderr
    cfg = read_checkpoint(str(tmp_path / "b"))[0]
    assert cfg.model.vocab_size == 272 and cfg.data.vocab_file == str(TOKENIZER / "vocab.json")


def test_a_wrongly_rebuilt_bucket_layout_is_refused_not_loaded(monkeypatch):
    """Two same-sized parameters in the wrong order pass the bucket-size check; the fp32 copies then differ
    from the weights saved beside them, and the optimizer state is refused (weights still load)."""
    from megalite.interop import torch_dist_optim as tdo
    from megalite.interop.torch_dist import TorchDistSource

    real = tdo.rank_order

    def swapped(*args):
        order = real(*args)
        i = next(k for k, (n, *_) in enumerate(order) if n.endswith("input_layernorm.weight"))
        j = next(k for k, (n, *_) in enumerate(order) if n.endswith("pre_mlp_layernorm.weight"))
        order[i], order[j] = order[j], order[i]
        return order

    monkeypatch.setattr(tdo, "rank_order", swapped)
    with pytest.raises(tdo.Unmappable, match="is not the weight saved beside it"):
        tdo.read_distributed_optimizer(TorchDistSource(str(FIXTURES / "llama_torch_dist" / "ckpt")))


# -- tp 2 x pp 2: the distributed optimizer's state in both of Megatron-LM's sharding modes ------------------
# the tied/ model's flags (make_fixture.py's "mp" style); Megatron's NullTokenizer 40 is 41 ids with eod
MP_RUN = [
    "--num-layers",
    "2",
    "--hidden-size",
    "16",
    "--num-attention-heads",
    "4",
    "--ffn-hidden-size",
    "24",
    "--seq-length",
    "16",
    "--max-position-embeddings",
    "16",
    "--swiglu",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "1",
    "--lr",
    "1e-4",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "40",
    "--make-vocab-size-divisible-by",
    "8",
    "--use-distributed-optimizer",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
    "--num-threads",
    "1",
]


@pytest.fixture(scope="module")
def tp2pp2(tmp_path_factory):
    return unpack_tp2pp2(tmp_path_factory.mktemp("tp2pp2"))


def _load(d: Path, caplog):
    """load_checkpoint (pretrain_gpt.py --load's) of ``d`` into a single-rank trainer of its model, with the
    saved run's Adam settings."""
    from dataclasses import replace

    from megalite.checkpointing import load_checkpoint
    from megalite.interop.torch_dist import TorchDistSource
    from megalite.parallel.state import ParallelState
    from megalite.training import Trainer
    from tests.helpers.parity import tiny_config

    src = TorchDistSource(str(d))
    a, cfg = src.args, tiny_config(gbs=1, mbs=1)
    optim = replace(
        cfg.optim,
        adam_beta1=a.adam_beta1,
        adam_beta2=a.adam_beta2,
        adam_eps=a.adam_eps,
        clip_grad=a.clip_grad,
        weight_decay=a.weight_decay,
    )
    t = Trainer(cfg.with_(model=src.cfg, optim=optim), ParallelState.single())
    caplog.clear()
    assert load_checkpoint(t.run_parts, str(d), formats=checkpoint_formats()) == 2
    return t


@pytest.mark.slow
def test_megatron_lm_tp2_pp2_optimizer_state_loads_in_both_sharding_modes(tp2pp2, caplog):
    """Megatron-LM at tp 2 x pp 2 (SwiGLU halves and query groups split over tp, biases) saved one trained state
    twice: flat per-rank gradient buckets (dp_reshardable) and its own per-parameter form (fully_reshardable).
    Both restore, bit for bit, the moments, fp32 weights and step Megatron's fully_reshardable file holds."""
    for style in ("untied", "tied"):
        truth = None
        for d in ("ckpt", "ckpt_full"):
            if (style, d) == ("tied", "ckpt_full"):
                continue  # below: Megatron's own file is wrong there
            t = _load(tp2pp2 / style / d, caplog)
            assert "distributed-optimizer state" in caplog.text and "Adam starts fresh" not in caplog.text
            assert t.optimizer.step_state()["adam_step"] == 2.0
            truth = truth or _megatron_model_space_state(tp2pp2 / style / "ckpt_full" / "iter_0000002", t.cfg.model)
            full = t.optimizer.full_state_dict()
            assert set(full) == set(truth) and len(truth) == (2 * 12 + 4 if style == "tied" else 2 * 10 + 3)
            weights = dict(t.chunks[0].named_parameters())
            for name, want in truth.items():
                assert torch.equal(full[name]["param"], weights[name].detach().float()), (style, d, name)
                if style == "tied" and name.endswith("word_embeddings.weight"):
                    continue
                for k, v in want.items():  # megalite's table has its own padding rows after the vocabulary
                    assert torch.equal(full[name][k][: len(v)], v.float()), (style, d, name, k)
                    assert not full[name][k][len(v) :].any(), (style, d, name, k)
                assert full[name]["exp_avg_sq"].abs().max() > 0, (style, d, name)


def test_megatron_lm_fully_reshardable_file_it_wrote_wrong_is_refused(tp2pp2, caplog):
    """With the tied embedding split over two stages it sits in a gradient bucket of its own, after a padded one;
    Megatron-LM core_v0.16.1's fully_reshardable save then reads it at the wrong offset and pads with zeros (it
    logs "can lead to data corruption"). The fp32 copy is not the saved weight: weights load, Adam starts fresh,
    one line names the tensor."""
    t = _load(tp2pp2 / "tied" / "ckpt_full", caplog)
    assert "Adam starts fresh" in caplog.text and "embedding.word_embeddings.weight is not the weight" in caplog.text
    assert t.optimizer.step_state()["adam_step"] == 0.0
    from megalite.interop.torch_dist import TorchDistSource

    src = TorchDistSource(str(tp2pp2 / "tied" / "ckpt_full"))
    saved = src.pre()[WORD_NAME]
    assert torch.equal(dict(t.chunks[0].named_parameters())[WORD_NAME].detach()[: len(saved)], saved)


WORD_NAME = "embedding.word_embeddings.weight"


@pytest.mark.slow
def test_megatron_lm_tp2_pp2_run_resumes_with_its_optimizer_state(tp2pp2):
    """pretrain_gpt.py --load on Megatron-LM's tp 2 x pp 2 dp_reshardable directory (tied embedding split over the
    stages), run at tp 1 (any layout loads): weights and distributed-optimizer state restored, iteration 3 trains."""
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "pretrain_gpt.py"),
            *MP_RUN,
            "--load",
            str(tp2pp2 / "tied" / "ckpt"),
            "--train-iters",
            "3",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stdout + done.stderr
    assert "(iteration 2): weights and distributed-optimizer state" in log, log[-3000:]
    assert "Adam starts fresh" not in log
    assert re.search(r" iteration +3/ +3 \|", log), log[-3000:]
