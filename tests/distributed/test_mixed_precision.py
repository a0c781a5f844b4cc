"""bf16 and fp16 training: loss curves within 2% of fp32, fp32 main weights, loss-scaler rules.

* one process (tests/unit/test_mixed_precision.py): bf16 and fp16 20-step loss curves within 2% of fp32;
* 3D layouts (tp x pp x dp, distributed optimizer): the same 2% bound against fp32 in one process;
* fp16 with an overflow forced on one rank at one step: every rank skips exactly that
  step (weights unchanged, LR schedule not advanced, "skipped iterations" counts it) and the
  scale halves; with hysteresis 2 the first overflow keeps the scale and the second halves it.
"""

from dataclasses import replace

import pytest

from tests.helpers.mixed_precision import STEPS, _assert_within_2_percent, _fp32_reference, _half, _tiny
from tests.helpers.parity import GPT2_STYLE, LLAMA_STYLE, _train, full_params, tiny_config


def _losses(ps, cfg, steps):
    _, losses, _ = _train(cfg, ps, steps)
    return {"losses": losses, "last": ps.is_last_stage}


@pytest.mark.parametrize("style,dtype,tp,pp,dp", [("gpt2", "bfloat16", 2, 2, 2), ("llama", "float16", 1, 2, 2)])
def test_half_precision_3d_follows_fp32(style, dtype, tp, pp, dp, run_distributed):
    ref = _fp32_reference(style, 2 * dp)
    base = _tiny(GPT2_STYLE if style == "gpt2" else LLAMA_STYLE, 2 * dp, tp=tp, pp=pp)
    cfg = _half(base, dtype, use_distributed_optimizer=True)
    if tp > 1:
        cfg = cfg.with_(parallel=replace(cfg.parallel, sequence_parallel=True))
    results = run_distributed(_losses, tp * pp * dp, cfg, STEPS, tp=tp, pp=pp)
    for r in results:
        if r["last"]:
            _assert_within_2_percent(r["losses"], ref["losses"])


def _overflow_run(ps, cfg, poison_steps, steps):
    """Train with an inf written into one gradient on global rank 0 at ``poison_steps``."""
    from megalite.training import Trainer
    from megalite.training.mock import MockFeed

    trainer = Trainer(cfg, ps)
    feed = MockFeed(trainer, steps)
    finalize, state = trainer.optimizer.finalize_grads, {"step": 0}

    def poisoned():
        finalize()
        if ps.rank == 0 and state["step"] in poison_steps:
            trainer.params[0].main_grad.view(-1)[0] = float("inf")

    trainer.optimizer.finalize_grads = poisoned
    log = []
    for step in range(steps):
        state["step"] = step
        before = full_params(trainer)
        out = trainer.train_step(feed.next())
        log.append(
            {
                "updated": out["updated"],
                "scale": out["loss_scale"],
                "changed": bool((full_params(trainer) != before).any()),
                "norm": out["grad_norm"],
            }
        )
    return {"log": log, "skipped": trainer.state.skipped_iters, "lr_steps": trainer.scheduler.num_steps}


def test_fp16_overflow_skips_that_step_everywhere_and_halves_scale(run_distributed):
    base = _half(tiny_config(GPT2_STYLE, gbs=4, mbs=1, num_layers=4, pp=2), "float16", lr_warmup_iters=0)
    cfg1 = base.with_(optim=replace(base.optim, hysteresis=1, initial_loss_scale=1024.0))
    results = run_distributed(_overflow_run, 4, cfg1, {2}, 4, pp=2)
    for r in results:
        log = r["log"]
        assert [e["updated"] for e in log] == [True, True, False, True]
        assert [e["changed"] for e in log] == [True, True, False, True]  # weights untouched at step 2
        assert [e["scale"] for e in log] == [1024.0, 1024.0, 512.0, 512.0]
        assert log[2]["norm"] is None and r["skipped"] == 1 and r["lr_steps"] == 3
    cfg2 = base.with_(optim=replace(base.optim, hysteresis=2, initial_loss_scale=1024.0))
    results = run_distributed(_overflow_run, 4, cfg2, {1, 2}, 4, pp=2)
    for r in results:
        log = r["log"]
        assert [e["updated"] for e in log] == [True, False, False, True]
        # hysteresis 2: the first overflow keeps the scale, the second halves it
        assert [e["scale"] for e in log] == [1024.0, 1024.0, 512.0, 512.0]
        assert r["skipped"] == 2 and r["lr_steps"] == 2
