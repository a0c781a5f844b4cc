"""What the log line's counters mean and what a finished run leaves behind (issue 33, "log semantics").

``number of skipped iterations`` (and ``number of nan iterations``) count the log interval, reset at
each log line as Megatron-LM's training_log does, so tools reading Megatron logs read megalite's alike.
"""

import re

import pretrain_gpt
from tests.helpers import TINY_RUN

RUN = TINY_RUN + ["--eval-iters", "0", "--num-threads", "1"]


def test_skipped_iterations_count_the_log_interval(capsys):
    # fp16 with a loss scale of 2^20 overflows this tiny model's gradients twice (2^20, then 2^19 with
    # --hysteresis 1), then trains: iterations 1 and 2 are skipped, 3 and 4 are not.
    flags = ["--fp16", "--initial-loss-scale", "1048576", "--hysteresis", "1", "--train-iters", "4"]
    assert pretrain_gpt.main(RUN + flags + ["--log-interval", "2"]) == 0
    out = capsys.readouterr().out
    skipped = [int(x) for x in re.findall(r"number of skipped iterations: +(\d+)", out)]
    nans = [int(x) for x in re.findall(r"number of nan iterations: +(\d+)", out)]
    assert skipped == [2, 0] and nans == [0, 0], out
    kernels = out.index("attention kernels (--attention-backend auto): causal: torch SDPA (is_causal); packed")
    assert kernels < out.index(" iteration ")  # said before training starts


def test_a_finished_trainer_frees_its_model_without_the_cycle_collector(tmp_path):
    """``del trainer`` after train() (evaluation and a save included) frees the parameters at once: no
    reference cycle through the trainer (a bound method of it held by its own parts) keeps them alive."""
    import gc
    import weakref

    import torch

    from megalite.checkpointing.save_lock import release_save_locks
    from megalite.config.arguments import parse_args
    from megalite.data.loading import build_datasets, resolve_data
    from megalite.parallel.state import ParallelState
    from megalite.training import Trainer

    flags = ["--train-iters", "2", "--eval-interval", "1", "--eval-iters", "1", "--save", str(tmp_path / "ck")]
    cfg = resolve_data(parse_args(TINY_RUN + ["--num-threads", "1"] + flags, world_size=1))
    ps = ParallelState.from_config(cfg)
    # torch imports lazily on a process's first optimizer and leaves that import's frames in a cycle once;
    # warm it up so the test sees megalite's references only
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], foreach=True)
    gc.collect()
    gc.disable()
    try:
        trainer = Trainer(cfg, ps)
        ds = build_datasets(cfg, ps)
        trainer.train(ds.train, ds.valid, test_ds=ds.test)
        release_save_locks()
        param = weakref.ref(trainer.params[0])
        del trainer, ds
        assert param() is None, "the parameters outlived the trainer (a reference cycle)"
    finally:
        gc.enable()
        ps.destroy()
