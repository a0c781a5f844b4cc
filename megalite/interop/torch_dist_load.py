"""Megatron-Core's torch_dist directories as a load source of a run (formats.LoadSource).

A run started with ``--load`` on a Megatron-LM checkpoint saved in its default format reads it in
place: the weights into this rank's slices, the distributed-optimizer state when it can be mapped,
the counters unless ``--finetune``. The composition root hands this source to the Checkpointer
(``megalite.interop.checkpoint_formats()``); the run's own load path never imports it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from megalite.checkpointing.safe_load import CheckpointError
from megalite.interop.torch_dist import load_torch_dist_weights, open_for_run, torch_dist_dir
from megalite.interop.torch_dist_optim import load_torch_dist_optimizer
from megalite.parallel.agreement import flag_on_any_rank

if TYPE_CHECKING:
    from megalite.checkpointing.run import RunParts

logger = logging.getLogger("megalite")
__all__ = ["TorchDistLoadSource"]


class TorchDistLoadSource:
    """Megatron-Core's ``--ckpt-format torch_dist`` (Megatron-LM's default), read in place."""

    name = "torch_dist"

    def find(self, root: str, step: Optional[int]) -> Optional[str]:
        """``root`` itself, its ``iter_<step>`` or what its latest file names, when that is torch_dist."""
        return torch_dist_dir(root, step)

    def load(self, run: "RunParts", d: str, finetune: bool, load_optim: bool) -> int:
        """Weights from ``d``, its distributed-optimizer state when it can be mapped (``load_optim``);
        counters unless ``finetune`` (collective). Returns the iteration loaded."""
        run.optimizer.finish_param_gather()
        error, counters, skipped = None, {}, "--no-load-optim" if not finetune else "--finetune"
        try:
            src = open_for_run(d, run.cfg.model)  # common.pt and the index read once for weights and optimizer
            counters = load_torch_dist_weights(src, run.cfg.model, run.model_parts, run.optimizer)
            if load_optim:  # the same answer on every rank: the layout is the file's, not the rank's
                skipped = load_torch_dist_optimizer(src, run.model_parts, run.optimizer)
        except CheckpointError as e:
            error = e
        failed = flag_on_any_rank(error is not None, run.ps)  # no rank goes on to train while another failed
        if error is not None:
            raise error
        if failed:
            raise CheckpointError(f"another rank could not read {d} (its error is printed above)")
        if not finetune:
            run.train_state.load_state_dict(counters)
            run.scheduler.load_state_dict({"num_steps": counters["iteration"]})  # the LR schedule follows it
        _report(run, d, counters["iteration"], skipped)
        return counters["iteration"]


def _report(run: "RunParts", d: str, iteration: int, skipped: Optional[str]) -> None:
    """What was restored, once per job."""
    if not run.ps.is_logging_rank:
        return
    if skipped is None:
        logger.warning(
            f"loaded Megatron-Core torch_dist checkpoint {d} (iteration {iteration}): "
            f"weights and distributed-optimizer state; its random states are not restored"
        )
    else:
        logger.warning(
            f"loaded the weights of Megatron-Core torch_dist checkpoint {d} (iteration "
            f"{iteration}); its optimizer state is not restored ({skipped}) nor its random "
            f"states: Adam starts fresh, as with --no-load-optim --no-load-rng"
        )
