"""LR schedule, gradient buffer, log line, mock data and sampler contracts (one process)."""

import math
import re

import numpy as np
import pytest
import torch

from megalite.config import OptimConfig
from megalite.data.mock_dataset import MockGPTDataset
from megalite.data.samplers import PretrainingSampler
from megalite.data_parallel.grad_buffer import GradBuffer
from megalite.observability.logging import format_log_line
from megalite.optim.lr_scheduler import LRScheduler
from megalite.parallel.state import ParallelState


def _sched(**kw):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    return LRScheduler(opt, OptimConfig(**kw), train_iters=100)


def test_lr_warmup_then_cosine_to_min():
    s = _sched(lr=1.0, min_lr=0.1, lr_warmup_iters=10, lr_decay_style="cosine")
    assert s.get_lr(0) == 0.0 and s.get_lr(5) == pytest.approx(0.5) and s.get_lr(10) == pytest.approx(1.0)
    assert s.get_lr(55) == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi * 0.5) + 1))
    assert s.get_lr(100) == pytest.approx(0.1) and s.get_lr(150) == pytest.approx(0.1)


def test_lr_linear_and_constant_and_optimizer_updated():
    s = _sched(lr=1.0, min_lr=0.0, lr_warmup_iters=0, lr_decay_style="linear")
    assert s.get_lr(25) == pytest.approx(0.75)
    s.step(25)
    assert s.optimizer.param_groups[0]["lr"] == pytest.approx(0.75)
    assert _sched(lr=0.3, lr_decay_style="constant").get_lr(77) == 0.3


def test_grad_buffer_accumulates_in_place_over_microbatches():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    buf = GradBuffer(list(model.parameters()), ParallelState.single().dp, bucket_elements=10)
    assert len(buf.buckets) >= 2
    ref = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    ref.load_state_dict(model.state_dict())
    buf.start_step(2)
    xs = [torch.randn(5, 4), torch.randn(5, 4)]
    for x in xs:
        model(x).square().sum().backward()
    buf.finish()
    sum(ref(x).square().sum() for x in xs).backward()
    flat = buf.grad_data
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)
        # still a view of the flat buffer
        assert flat.data_ptr() <= p.grad.data_ptr() < flat.data_ptr() + flat.numel() * flat.element_size()
    buf.start_step(1)
    assert all(float(p.grad.abs().sum()) == 0 for p in model.parameters())


def test_grad_buffer_accumulates_bf16_grads_in_fp32_main_grad():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    buf = GradBuffer(list(model.parameters()), ParallelState.single().dp, grad_dtype=torch.float32)
    assert buf.grad_data.dtype == torch.float32 and buf.accumulate_in_hook
    buf.start_step(3)
    xs = [torch.randn(2, 8, dtype=torch.bfloat16) for _ in range(3)]
    expected = torch.zeros(4, 8)
    for x in xs:
        model(x).float().sum().backward()
        expected += torch.ones(2, 4).t().matmul(x.float())  # d(sum)/dW per micro-batch, fp32 sum
    buf.finish()
    assert model.weight.grad is None  # moved into main_grad by the hook, bf16 copy freed
    assert model.weight.main_grad.dtype == torch.float32
    assert torch.allclose(model.weight.main_grad, expected, atol=0.05)


def test_log_line_has_megatron_keys_in_order():
    line = format_log_line(10, 100, 160, 123.45, 1.23, 1e-4, 16, 2.5, 0.75, 0, 0, 5000.0, 65536.0)
    keys = [
        "iteration",
        "consumed samples:",
        "elapsed time per iteration (ms):",
        "throughput per GPU (TFLOP/s/GPU):",
        "learning rate:",
        "global batch size:",
        "lm loss:",
        "loss scale:",
        "grad norm:",
        "number of skipped iterations:",
        "number of nan iterations:",
        "tokens per second:",
    ]
    positions = [line.index(k) for k in keys]
    assert positions == sorted(positions)
    assert re.search(r" iteration +10/ +100 \| consumed samples: +160 \|", line)
    assert "lm loss: 2.500000E+00 | loss scale: 65536.0 |" in line and "learning rate: 1.000000E-04 |" in line


def test_mock_data_is_deterministic_and_learnable_pattern():
    a, b = MockGPTDataset(16, 100, 5, 10), MockGPTDataset(16, 100, 5, 10)
    assert all(np.array_equal(a[i]["text"], b[i]["text"]) for i in range(10))
    assert not np.array_equal(a[0]["text"], MockGPTDataset(16, 100, 6, 10)[0]["text"])
    t = a[3]["text"]
    assert len(t) == 17 and t.min() >= 0 and t.max() < 100
    assert len(set(np.diff(t) % 100)) == 1  # an arithmetic sequence modulo the vocabulary


@pytest.mark.parametrize("mbs,dp", [(2, 1), (1, 2), (2, 2), (1, 4)])
def test_global_batch_union_is_layout_independent(mbs, dp):
    gbs = 8
    m = gbs // (mbs * dp)
    per_rank = [list(PretrainingSampler(64, 16, mbs, r, dp)) for r in range(dp)]
    for it in range(3):
        union = sorted(i for r in range(dp) for mb in per_rank[r][it * m : (it + 1) * m] for i in mb)
        assert union == list(range(16 + it * gbs, 16 + (it + 1) * gbs))


@pytest.mark.parametrize("dp_rank", [0, 1])
def test_sampler_resumed_at_consumed_samples_reads_what_the_run_would_have(dp_rank):
    full = list(PretrainingSampler(100, 0, 2, dp_rank, 2))
    resumed = list(PretrainingSampler(100, 40, 2, dp_rank, 2))
    assert resumed == full[10:]  # 40 consumed samples = 10 micro-steps of 2 x dp 2
    assert {i for mb in full for i in mb}.isdisjoint(
        {i for mb in PretrainingSampler(100, 0, 2, 1 - dp_rank, 2) for i in mb}
    )


def test_validation_follows_megatrons_plan():
    """Each evaluation reads the next eval_iters batches; the split is sized for all of them plus one."""
    from megalite.config import TrainConfig
    from megalite.data.loading import valid_samples_before, validation_plan

    t = TrainConfig(train_iters=10, global_batch_size=4, eval_interval=3, eval_iters=2)
    assert validation_plan(t) == (40, (10 // 3 + 1) * 2 * 4, 2 * 4)
    # evaluations at 3, 6, 9 and at the end (10): each starts after the ones before
    assert [valid_samples_before(i, t) for i in (3, 6, 9, 10)] == [0, 8, 16, 24]
    assert validation_plan(TrainConfig(eval_iters=0)) == (TrainConfig().train_iters * 16, 0, 0)


def test_mock_data_vocabulary_is_the_tokenizers_when_one_is_given():
    """--mock-data --vocab-size N: N ids; with --tokenizer-type NullTokenizer, Megatron's N + 1 (eod = N)."""
    from megalite.config.arguments import parse_args
    from megalite.data.loading import resolve_data

    assert resolve_data(parse_args(["--mock-data", "--vocab-size", "100"])).model.vocab_size == 100
    cfg = resolve_data(parse_args(["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]))
    assert cfg.model.vocab_size == 101
