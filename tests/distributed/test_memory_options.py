"""Recomputation, sequence parallelism and the distributed optimizer change memory, not numbers.

* recompute (full/uniform, full/block, selective; SDPA and unfused attention) under
  tp=2 x pp=2 with interleaving and dropout on: losses, gradients and weights equal the
  same layout without recompute (the dropout masks of the recomputed forward are the same);
* sequence parallelism at tp 2 and 4 with pp: equals the single-process run;
* the distributed optimizer at dp 2 and 4 with tp and pp (with overlapped reduce-scatter
  and parameter all-gather, several buckets): equals the single-process run over 5 steps,
  global grad norm included, and each rank holds 1/dp of the optimizer state.
"""

from dataclasses import replace

import pytest
import torch

from megalite.parallel.state import ParallelState
from megalite.training import Trainer
from tests.helpers.parity import (
    GPT2_STYLE,
    LLAMA_STYLE,
    _train,
    assert_close_run,
    full_params,
    reference_run,
    run_steps,
    tiny_config,
)

RECOMPUTE_MODES = {
    "none": {},
    "full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full-uniform-2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full-block-1": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective"),
    "none-unfused": dict(attention_backend="unfused"),
    "selective-unfused": dict(recompute_granularity="selective", attention_backend="unfused"),
}


def _run_modes(ps, base, modes, steps):
    out = {}
    for name, overrides in modes.items():
        cfg = base.with_(model=replace(base.model, **overrides))
        trainer, losses, norms = _train(cfg, ps, steps)
        grads = torch.cat([p.main_grad.reshape(-1) for p in trainer.params])
        out[name] = {"losses": losses, "norms": norms, "params": full_params(trainer).numpy(), "grads": grads.numpy()}
    return out


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def test_recompute_equals_no_recompute_with_dropout_under_tp_and_interleaved_pp(run_distributed):
    base = tiny_config(LLAMA_STYLE, gbs=4, mbs=1, num_layers=8, schedule="interleaved_1f1b", tp=2, pp=2, vp=2)
    base = base.with_(model=replace(base.model, hidden_dropout=0.1, attention_dropout=0.1))
    results = run_distributed(_run_modes, 4, base, RECOMPUTE_MODES, 3, tp=2, pp=2)
    for rank, res in enumerate(results):
        for name in RECOMPUTE_MODES:
            plain = res["none-unfused" if "unfused" in name else "none"]
            got = res[name]
            if rank >= 2:  # last pipeline stage: the loss is known there
                for a, b in zip(got["losses"], plain["losses"]):
                    assert abs(a - b) <= 1e-6 * abs(b), (rank, name, got["losses"], plain["losses"])
            for a, b in zip(got["norms"], plain["norms"]):
                assert abs(a - b) <= 1e-6 * abs(b), (rank, name, got["norms"], plain["norms"])
            assert _rel(torch.from_numpy(got["grads"]), torch.from_numpy(plain["grads"])) <= 1e-6, (rank, name)
            assert _rel(torch.from_numpy(got["params"]), torch.from_numpy(plain["params"])) <= 1e-6, (rank, name)
        # dropout really is on: the two attention paths draw different masks
        assert res["none"]["losses"] != res["none-unfused"]["losses"] or rank < 2


SP_CASES = [("tied", 2, 2, 1), ("tied", 4, 2, 1), ("untied", 2, 2, 2)]  # llama style has 2 query groups


@pytest.mark.parametrize("emb,tp,pp,vp", SP_CASES, ids=[f"{c[0]}-tp{c[1]}pp{c[2]}vp{c[3]}" for c in SP_CASES])
def test_sequence_parallel_matches_single_process(emb, tp, pp, vp, run_distributed):
    style = GPT2_STYLE if emb == "tied" else LLAMA_STYLE
    cfg = tiny_config(
        style, gbs=4, mbs=2, num_layers=4, tp=tp, pp=pp, vp=vp, schedule="interleaved_1f1b" if vp > 1 else None
    )
    ref = reference_run(cfg, 3)
    cfg = cfg.with_(parallel=replace(cfg.parallel, sequence_parallel=True))
    results = run_distributed(run_steps, tp * pp, cfg, 3, ref["state"], tp=tp, pp=pp)
    assert_close_run(results, ref)


def _optimizer_bytes(trainer):
    from megalite.training import Trainer

    opt = trainer.optimizer
    # the per-shard state loads into a fresh run of the same layout: same weights everywhere
    fresh = Trainer(trainer.cfg, trainer.ps)
    fresh.optimizer.load_sharded_state_dict(opt.sharded_state_dict())
    reloaded_equal = bool(torch.equal(full_params(fresh), full_params(trainer)))
    owned = sum(pc.end - pc.start for pc in opt.pieces)
    full = opt.full_state_dict() if trainer.ps.tp_size == 1 else {}  # numpy: no shared-memory handles
    full = {n: {k: torch.as_tensor(v).numpy() for k, v in e.items()} for n, e in full.items()}
    return {
        "full_state": full,
        "state_bytes": opt.state_bytes(),
        "owned": owned,
        "local_numel": sum(p.numel() for p in opt.params),
        "dp_rank": trainer.ps.dp_rank,
        "mp_rank": trainer.ps.mp.rank,
        "buckets": len(opt.grads.buckets),
        "reloaded_equal": reloaded_equal,
    }


DIST_OPT_CASES = [  # (embeddings, tp, pp, dp, overlap)
    ("tied", 2, 2, 2, True),
    ("untied", 1, 2, 4, False),
]


@pytest.mark.parametrize(
    "emb,tp,pp,dp,overlap",
    DIST_OPT_CASES,
    ids=[f"{c[0]}-tp{c[1]}pp{c[2]}dp{c[3]}{'-overlap' if c[4] else ''}" for c in DIST_OPT_CASES],
)
def test_distributed_optimizer_matches_single_process_and_shards_state(emb, tp, pp, dp, overlap, run_distributed):
    style = GPT2_STYLE if emb == "tied" else LLAMA_STYLE
    steps = 5
    cfg = tiny_config(style, gbs=2 * dp, mbs=1, num_layers=4, tp=tp, pp=pp)
    ref = reference_run(cfg, steps)
    optim = replace(
        cfg.optim,
        use_distributed_optimizer=True,
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap,
        ddp_bucket_size=2000 if overlap else None,
    )
    results = run_distributed(
        run_steps, tp * pp * dp, cfg.with_(optim=optim), steps, ref["state"], _optimizer_bytes, tp=tp, pp=pp
    )
    assert_close_run(results, ref)
    assert all(r["reloaded_equal"] for r in results)
    if tp == 1:  # the shards, gathered, are the plain optimizer's state of the same run
        one = cfg.with_(parallel=replace(cfg.parallel, pp=1))  # the same run in one process
        trainer, _, _ = _train(one, ParallelState.single(), steps)
        whole = trainer.optimizer.full_state_dict()
        merged = {}
        for r in results:
            assert r["full_state"]
            for name, entry in r["full_state"].items():
                for key in ("param", "exp_avg", "exp_avg_sq"):
                    assert _rel(torch.from_numpy(entry[key]), whole[name][key]) <= 1e-4, (name, key)
                merged[name] = {k: torch.from_numpy(v) for k, v in entry.items()}
        # ...and load as a whole into another layout (one process, plain optimizer)
        fresh = Trainer(one, ParallelState.single())
        fresh.optimizer.load_full_state_dict(merged)
        for name, p in fresh.chunks[0].named_parameters():
            assert _rel(p.detach(), ref["state"][name]) <= 1e-5, name
        fresh.optimizer.zero_grad(1)
        assert fresh.optimizer.step()[0]  # Adam's step count came along: the update runs
    by_mp = {}
    for r in results:
        by_mp.setdefault(r["mp_rank"], []).append(r)
    for group in by_mp.values():
        assert len(group) == dp
        local = group[0]["local_numel"]
        # the shards cover this model-parallel rank's parameters exactly once...
        assert sum(r["owned"] for r in group) == local
        for r in group:
            # ...each DP rank owns 1/dp of them, up to the padding of each bucket to a multiple of dp x 64
            assert abs(r["owned"] - local / dp) <= r["buckets"] * 64 * dp, (r["owned"], local / dp)
            # fp32 Adam: exp_avg + exp_avg_sq = 8 bytes per owned element (main weights are the model's)
            assert r["state_bytes"] == 8 * r["owned"]
