"""--async-save's exact resume, run in one process (tests/unit) and on gloo ranks (tests/distributed): save
every iteration in the background, exit, resume; the losses must equal the uninterrupted run's."""

import os
from dataclasses import replace

from megalite.checkpointing import iteration_dir, read_latest
from tests.helpers.parity import GPT2_STYLE, tiny_config, train_losses

STEPS = 4
SAVED = STEPS - 2  # the first run saves every iteration and exits here; the resumed run trains two more


def _cfg(style=GPT2_STYLE, tp=1, pp=1, dp=1, **optim):
    cfg = tiny_config(style, gbs=4, mbs=1 if dp * pp > 1 else 2, num_layers=4, tp=tp, pp=pp)
    return cfg.with_(
        model=replace(cfg.model, hidden_dropout=0.1, attention_dropout=0.1),
        optim=replace(cfg.optim, **optim),
        train=replace(cfg.train, train_iters=STEPS),
    )


def _resume(ps, cfg, root, fmt):
    whole = train_losses(ps, cfg)
    from megalite.checkpointing import async_save

    real, threaded = async_save.SaveJob.run, []

    def run(job, background=False):  # the writes really ran in a thread of their own
        threaded.append(background)
        return real(job, background=background)

    async_save.SaveJob.run = run
    try:
        # async saves at 1 and 2 (the exit); the resumed run's last loss follows an update made with the
        # loaded Adam moments, so wrong optimizer state shows
        first = train_losses(ps, cfg, save=root, fmt=fmt, exit_at=SAVED, save_interval=1, async_save=True)
    finally:
        async_save.SaveJob.run = real
    published = [os.path.isdir(iteration_dir(root, it)) for it in range(1, SAVED + 1)]
    second = train_losses(ps, cfg, load=root)
    return {
        "whole": whole,
        "resumed": first + second,
        "last": ps.is_last_stage,
        "published": published,
        "latest": read_latest(root),
        "background": threaded,
    }


def _check_resume(results):
    for r in results:
        assert r["published"] == [True] * SAVED and r["latest"] == SAVED, r
        assert r["background"] == [True] * SAVED, r["background"]
        if r["last"]:
            assert len(r["resumed"]) == STEPS and r["resumed"] == r["whole"], (r["resumed"], r["whole"])
