"""The mixture-of-experts parity runs (tests/distributed/test_moe_parity.py explains the layouts and the
capacity path): the tiny MoE config on any layout, its one-process reference, training on a rank grid and
the comparison within RTOL."""

from dataclasses import replace

from megalite.config import Config
from megalite.moe import moe_layers
from megalite.moe.metrics import reduce_moe_stats
from megalite.parallel.state import ParallelState
from megalite.training import Trainer
from megalite.training.mock import MockFeed
from tests.helpers.parity import LLAMA_STYLE, param_error, tiny_config

STEPS = 2
RTOL = 1e-5
MOE = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, moe_ffn_hidden_size=48)
FEATURES = dict(
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_bias_update_rate=1e-2,
    moe_shared_expert_intermediate_size=32,
    moe_shared_expert_gate=True,
)
CAPACITY = dict(moe_expert_capacity_factor=0.5)
GPT2_STYLE = dict(
    normalization="LayerNorm",
    swiglu=False,
    position_embedding_type="learned_absolute",
    add_bias_linear=True,
    untie_embeddings_and_output_weights=False,
    num_query_groups=None,
)


def moe_config(
    model=None,
    layers: int = 2,
    gbs: int = 8,
    mbs: int = 2,
    dispatcher: str = "alltoall",
    tp: int = 1,
    pp: int = 1,
    vp: int = 1,
    schedule: str = None,
    ep: int = 1,
    etp: int = None,
    optim=None,
) -> Config:
    """The tiny Llama-style MoE model of every case on one layout (ep 1, tp 1, pp 1: one process)."""
    cfg = tiny_config(
        {**LLAMA_STYLE, **MOE, **(model or {})},
        gbs=gbs,
        mbs=mbs,
        num_layers=layers,
        schedule=schedule,
        tp=tp,
        pp=pp,
        vp=vp,
    )
    return cfg.with_(
        parallel=replace(cfg.parallel, ep=ep, etp=etp, moe_token_dispatcher_type=dispatcher, sequence_parallel=tp > 1),
        optim=replace(cfg.optim, **(optim or {})),
    )


def one_process(cfg: Config) -> Config:
    """``cfg`` on one process: the reference of every layout of the same model and batch."""
    return cfg.with_(
        parallel=replace(
            cfg.parallel, tp=1, pp=1, vp=1, cp=1, ep=1, etp=None, pipeline_schedule=None, sequence_parallel=False
        ),
        optim=replace(cfg.optim, use_distributed_optimizer=False),
    )


def train(ps: ParallelState, cfg: Config, steps: int, reference=None) -> dict:
    """``steps`` iterations on mock data: losses, logged MoE losses, grad norms (and the final weights'
    error against ``reference``, or the full state when none is given)."""
    trainer = Trainer(cfg, ps)
    feed = MockFeed(trainer, steps)
    out = {"losses": [], "norms": [], "aux": [], "rank": ps.rank, "last_stage": ps.is_last_stage}
    for _ in range(steps):
        step = trainer.train_step(feed.next())
        out["losses"].append(step["loss"])
        out["norms"].append(step["grad_norm"])
        out["aux"].append(logged_moe_losses(trainer, ps))
    out["paired"] = sum(bool(e.get("paired")) for e in trainer.last_stats.events)  # F/B run side by side
    trainer.optimizer.finish_param_gather()
    if reference is None:
        out["state"] = {k: v.detach().clone() for k, v in trainer.chunks[0].state_dict().items()}
    else:
        out["param_err"] = param_error(trainer, reference)
    return out


def logged_moe_losses(trainer: Trainer, ps: ParallelState) -> dict:
    """The iteration's load-balancing and z losses as the log line reports them (every rank's
    layers reduced across ranks), per layer; the stats are then cleared for the next iteration."""
    layers = [layer for c in trainer.chunks for layer in moe_layers([c])]
    reduced = reduce_moe_stats(layers, ps, trainer.m, trainer.cfg.model)  # a stage may hold none
    for layer in layers:
        layer.reset_stats()
    return {k: float(v) for k, v in reduced.items() if "loss" in k}


_REFS: dict = {}


def reference(cfg: Config) -> dict:
    """The one-process run of ``cfg``, cached for the module (layouts of one model share it)."""
    cfg = one_process(cfg)
    key = repr(cfg)
    if key not in _REFS:
        _REFS[key] = train(ParallelState.single(), cfg, STEPS)
    return _REFS[key]


def train_variants(ps: ParallelState, runs) -> list:
    """Several trainings on one rank grid, one after the other: ``runs`` = [(cfg, reference state)]."""
    return [train(ps, cfg, STEPS, state) for cfg, state in runs]


def assert_matches(results, ref: dict, what: str) -> None:
    """Every last-stage rank's losses, every rank's logged MoE losses and grad norms, every rank's
    weights equal the one-process run within RTOL."""

    def close(a, b):
        return abs(a - b) <= RTOL * max(abs(b), 1e-8)

    assert ref["aux"][0], f"{what}: the reference logged no MoE losses"
    for r in results:
        for step in range(STEPS):
            if r["last_stage"]:
                a, b = r["losses"][step], ref["losses"][step]
                assert close(a, b), f"{what} rank {r['rank']} step {step}: loss {a!r} != {b!r}"
            a, b = r["norms"][step], ref["norms"][step]
            assert close(a, b), f"{what} rank {r['rank']} step {step}: grad norm {a!r} != {b!r}"
            assert r["aux"][step].keys() == ref["aux"][step].keys(), f"{what}: {r['aux'][step]} vs {ref['aux'][step]}"
            for k, b in ref["aux"][step].items():
                a = r["aux"][step][k]
                assert close(a, b), f"{what} rank {r['rank']} step {step}: {k} {a!r} != {b!r}"
        assert r["param_err"] <= RTOL, f"{what} rank {r['rank']}: weights differ by {r['param_err']:.2e}"


def moe_cfg(model=None, **parallel):
    """The unit tests' tiny MoE config (Llama style, 4 experts, top-2) with ``parallel``'s sizes."""
    cfg = tiny_config({**LLAMA_STYLE, **MOE, **(model or {})}, gbs=8, mbs=2, num_layers=2)
    return cfg.with_(parallel=replace(cfg.parallel, **parallel)) if parallel else cfg
