"""The half-precision tests' runs: tiny_config trained STEPS iterations in bf16/fp16, the fp32 one-process
reference, and the 2% bound every step of the curve must keep."""

from dataclasses import replace

from tests.helpers.parity import GPT2_STYLE, LLAMA_STYLE, reference_run, tiny_config

STEPS = 20


def _fp32_reference(style_name, gbs):
    return reference_run(_tiny(GPT2_STYLE if style_name == "gpt2" else LLAMA_STYLE, gbs), STEPS)  # cached


def _tiny(style, gbs, **layout):
    """tiny_config trained for STEPS iterations (its LR schedule spans the run)."""
    cfg = tiny_config(style, gbs=gbs, mbs=1, num_layers=4, **layout)
    return cfg.with_(train=replace(cfg.train, train_iters=STEPS))


def _half(cfg, dtype, **optim):
    return cfg.with_(
        model=replace(cfg.model, params_dtype=dtype),
        optim=replace(
            cfg.optim, accumulate_allreduce_grads_in_fp32=dtype == "bfloat16", initial_loss_scale=2.0**8, **optim
        ),
    )  # no overflow in these runs


def _assert_within_2_percent(losses, ref):
    assert len(losses) == len(ref) == STEPS
    for step, (a, b) in enumerate(zip(losses, ref)):
        assert abs(a - b) <= 0.02 * abs(b), f"step {step}: {a} vs fp32 {b}"
    assert ref[-1] < ref[0] - 0.2  # the curve being followed really falls
