"""Context parallelism reproduces the single-process run (issue 19's parity matrix).

Every case trains a few Adam iterations in fp32 with dropout 0 and must match one process within
1e-5 in the loss of every iteration, the grad norm and the final weights: cp2 and cp4 with each
--cp-comm-type, cp2 x tp2 with --sequence-parallel (and selective recompute around the ring
attention), cp2 x pp2 (1F1B, interleaved and ZB-V), cp2 x dp2 with --use-distributed-optimizer,
packed documents (--reset-position-ids --reset-attention-mask --eod-mask-loss) at cp2 and on the
middle stages of a pipeline; a checkpoint saved at cp2 resumes at cp1 and one saved at cp1 resumes
at cp2. Cases sharing a rank grid share one launch (about 2 s to start on 2 cores).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, List

import numpy as np
import pytest

from megalite.config import Config
from megalite.data.mock_dataset import MockGPTDataset
from megalite.parallel.state import ParallelState
from megalite.training.mock import train_mock
from tests.helpers.parity import GPT2_STYLE, LLAMA_STYLE, assert_close_run, param_error, tiny_config, train_losses

pytestmark = pytest.mark.slow

STEPS = 3
PACKED = dict(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)


class PackedMock:
    """Mock samples with end-of-document tokens (id vocab-1, NullTokenizer's eod) at a few places."""

    def __init__(self, seq_length: int, vocab_size: int, seed: int, num_samples: int):
        self.base = MockGPTDataset(seq_length, vocab_size, seed, num_samples)
        self.eod = vocab_size - 1

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> Dict[str, np.ndarray]:
        text = self.base[i]["text"].copy()
        rng = np.random.default_rng([self.base.seed, i, 1])
        text[rng.choice(len(text) - 1, size=int(rng.integers(1, 4)), replace=False)] = self.eod
        return {"text": text}


def _config(
    style: dict, cp: int, comm: str = "p2p", packed: bool = False, gbs: int = 4, mbs: int = 2, **parallel
) -> Config:
    cfg = tiny_config(style, gbs=gbs, mbs=mbs, num_layers=parallel.pop("num_layers", 2))
    cfg = cfg.with_(parallel=replace(cfg.parallel, cp=cp, cp_comm_type=comm, **parallel))
    return cfg.with_(data=replace(cfg.data, **PACKED)) if packed else cfg


def _dataset(cfg: Config, packed: bool):
    if not packed:
        return None  # train_mock's own mock samples
    return PackedMock(cfg.model.seq_length, cfg.model.vocab_size, cfg.train.seed, STEPS * cfg.train.global_batch_size)


_REFS: Dict[str, dict] = {}


def _reference(cfg: Config, packed: bool) -> dict:
    """The same run in one process (cached by config)."""
    # comm type, recompute and the distributed optimizer (at dp 1) change no arithmetic: one reference for all
    one = cfg.with_(
        parallel=replace(
            cfg.parallel, tp=1, pp=1, vp=1, cp=1, cp_comm_type="p2p", pipeline_schedule=None, sequence_parallel=False
        ),
        optim=replace(cfg.optim, use_distributed_optimizer=False),
        model=replace(cfg.model, recompute_granularity=None),
    )
    key = repr((one, packed))
    if key not in _REFS:
        trainer, losses, norms = train_mock(one, ParallelState.single(), STEPS, dataset=_dataset(one, packed))
        _REFS[key] = {
            "losses": losses,
            "norms": norms,
            "state": {k: v.detach().clone() for k, v in trainer.chunks[0].state_dict().items()},
        }
    return _REFS[key]


def _run_cases(ps: ParallelState, cases: List[tuple]) -> List[List[dict]]:
    """Each (cfg, packed, reference state) trained STEPS iterations on this grid, one after the other."""
    out = []
    for cfg, packed, state in cases:
        trainer, losses, norms = train_mock(cfg, ps, STEPS, dataset=_dataset(cfg, packed))
        trainer.optimizer.finish_param_gather()
        out.append(
            {
                "losses": losses,
                "norms": norms,
                "param_err": param_error(trainer, state),
                "rank": ps.rank,
                "last_stage": ps.is_last_stage,
            }
        )
    return out


def _check(run_distributed, world: int, cases: List[tuple], tp: int = 1, pp: int = 1, cp: int = 2) -> None:
    """Run ``cases`` [(name, cfg, packed)] in one launch of ``world`` ranks and compare each with one process."""
    refs = [_reference(cfg, packed) for _, cfg, packed in cases]
    per_rank = run_distributed(
        _run_cases,
        world,
        [(cfg, packed, ref["state"]) for (_, cfg, packed), ref in zip(cases, refs)],
        tp=tp,
        pp=pp,
        cp=cp,
    )
    for i, ((name, _, _), ref) in enumerate(zip(cases, refs)):
        try:
            assert_close_run([r[i] for r in per_rank], ref, rtol=1e-5, param_rtol=1e-5)
            for r in per_rank:
                for a, b in zip(r[i]["norms"], ref["norms"]):
                    assert abs(a - b) <= 1e-5 * abs(b), f"grad norm {a} != {b}"
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


def test_cp2_each_comm_type_and_packed_documents(run_distributed):
    cases = [(f"cp2 {comm}", _config(LLAMA_STYLE, 2, comm), False) for comm in ("p2p", "all_gather", "a2a")]
    cases += [
        ("cp2 packed rope p2p", _config(LLAMA_STYLE, 2, "p2p", packed=True), True),
        ("cp2 packed learned all_gather", _config(GPT2_STYLE, 2, "all_gather", packed=True), True),
    ]
    _check(run_distributed, 2, cases)


def test_cp4_each_comm_type(run_distributed):
    _check(
        run_distributed,
        4,
        [(f"cp4 {comm}", _config(GPT2_STYLE, 4, comm), False) for comm in ("p2p", "all_gather", "a2a")],
        cp=4,
    )


def test_cp2_with_tp2_sequence_parallel(run_distributed):
    recompute = _config(LLAMA_STYLE, 2, "p2p", tp=2, sequence_parallel=True)
    recompute = recompute.with_(model=replace(recompute.model, recompute_granularity="selective"))
    _check(
        run_distributed,
        4,
        [
            ("cp2 tp2 sp p2p selective recompute", recompute, False),
            ("cp2 tp2 sp a2a packed", _config(GPT2_STYLE, 2, "a2a", packed=True, tp=2, sequence_parallel=True), True),
        ],
        tp=2,
    )


def test_cp2_with_pp2_schedules(run_distributed):
    cases = [
        ("cp2 pp2 1f1b", _config(LLAMA_STYLE, 2, "p2p", num_layers=4, pp=2, pipeline_schedule="1f1b"), False),
        (
            "cp2 pp2 interleaved packed",
            _config(LLAMA_STYLE, 2, "p2p", packed=True, num_layers=4, pp=2, vp=2, pipeline_schedule="interleaved_1f1b"),
            True,
        ),
        (
            "cp2 pp2 zero-bubble V a2a",
            _config(LLAMA_STYLE, 2, "a2a", num_layers=4, pp=2, vp=2, pipeline_schedule="zbv"),
            False,
        ),
    ]
    _check(run_distributed, 4, cases, pp=2)


def test_packed_documents_reach_middle_pipeline_stages(run_distributed):
    # pp 4: ranks 1 and 2 hold neither embedding nor loss, yet their attention and RoPE need the documents
    cfg = _config(LLAMA_STYLE, 1, "p2p", packed=True, num_layers=4, pp=4, pipeline_schedule="1f1b")
    _check(run_distributed, 4, [("pp4 packed 1f1b", cfg, True)], pp=4, cp=1)


def test_cp2_with_dp2_distributed_optimizer(run_distributed):
    cfg = _config(LLAMA_STYLE, 2, "all_gather")
    cfg = cfg.with_(optim=replace(cfg.optim, use_distributed_optimizer=True))
    _check(run_distributed, 4, [("cp2 dp2 distributed optimizer", cfg, False)])


def _resume(ps: ParallelState, cfg: Config, load_dir: str, save_dir: str) -> tuple:
    """At cp2: continue cp1's checkpoint to the end, then a fresh run saved at iteration 2."""
    resumed = train_losses(ps, cfg, load=load_dir)
    first = train_losses(ps, cfg, save=save_dir, exit_at=2)
    return resumed, first


def test_checkpoint_moves_between_cp_sizes(tmp_path, run_distributed):
    cfg2 = _config(LLAMA_STYLE, 2, "p2p")
    cfg2 = cfg2.with_(train=replace(cfg2.train, train_iters=4))
    cfg1 = cfg2.with_(parallel=replace(cfg2.parallel, cp=1))
    single = ParallelState.single()
    whole = train_losses(single, cfg1)
    assert train_losses(single, cfg1, save=str(tmp_path / "cp1"), exit_at=2) == whole[:2]
    results = run_distributed(_resume, 2, cfg2, str(tmp_path / "cp1"), str(tmp_path / "cp2"), cp=2)
    for resumed, first in results:
        np.testing.assert_allclose(resumed, whole[2:], rtol=1e-5)  # saved at cp1, resumed at cp2
        np.testing.assert_allclose(first, whole[:2], rtol=1e-5)
    np.testing.assert_allclose(train_losses(single, cfg1, load=str(tmp_path / "cp2")), whole[2:], rtol=1e-5)
