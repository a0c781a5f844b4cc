"""Mixture-of-experts layouts reproduce the single-process run (fp32, dropout 0).

Every layout trains a tiny MoE GPT (4 experts, top-2, aux-loss coefficient 1e-2, z-loss 1e-3)
for STEPS iterations from the same initial weights on the same samples as one process, and
must give the same losses, logged load-balancing and z losses, grad norms and final weights
within 1e-5 (relative). The layouts, each one gloo run (variants of one rank grid share it):

    ep2 x dp2                 alltoall, dropless; then the capacity path (below); then allgather
    tp2 (SP) x ep2, ETP 1     alltoall          (expert DP 2: experts unsharded over TP)
    tp2 (SP) x ep2, ETP 2     allgather         (expert DP 1: experts sharded like TP weights)
    pp2 x ep2                 interleaved 1F1B, then ZB-V (expert weight GEMMs deferred to W), then
                              DualPipeV with each F/B pair run side by side (dispatch overlapped)
    tp2 x pp2 x ep2 (world 8) distributed optimizer, ETP 1 (expert DP 2), sigmoid router with
                              expert bias (DeepSeek-V3 balancing) and a gated shared expert

The capacity path. Capacity is computed per rank from the tokens that rank routes:
ceil(tokens x topk / experts x capacity_factor), tokens = mbs x seq of one micro-batch (the
router runs before dispatch, on this rank's own micro-batch, and drops its over-capacity
tokens there). Data parallelism hands each rank whole micro-batches that are exactly micro-
batches of the one-process run (micro-batch k of dp rank r holds samples k*mbs*dp + r*mbs ..
+ mbs, a consecutive run of mbs aligned to mbs, as are the one-process run's). With TP = 1
the router of a rank therefore sees exactly the tokens the one-process router sees for that
micro-batch, computes the same capacity, and drops the same (token, expert) choices: "the
same tokens" means the same positions of the same micro-batch. (Under sequence parallelism
a rank routes only seq/tp of them and its capacity is per shard, which a one-process run
cannot reproduce, so the capacity check runs at TP = 1.) The factor 0.5 makes drops certain:
the reference's loss must differ from the dropless run's.
"""
from dataclasses import replace

import pytest
import torch

from megalite.config import Config
from megalite.moe import moe_layers
from megalite.moe.metrics import reduce_moe_stats
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel.layers import WeightGradStore, enable_weight_grad_split
from megalite.testing import run_distributed
from megalite.training import Trainer
from megalite.training.mock import MockFeed
from tests.distributed.common import LLAMA_STYLE, param_error, tiny_config

STEPS = 2
RTOL = 1e-5
MOE = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
           moe_ffn_hidden_size=48)
FEATURES = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_bias_update_rate=1e-2, moe_shared_expert_intermediate_size=32,
                moe_shared_expert_gate=True)
CAPACITY = dict(moe_expert_capacity_factor=0.5)
GPT2_STYLE = dict(normalization="LayerNorm", swiglu=False, position_embedding_type="learned_absolute",
                  add_bias_linear=True, untie_embeddings_and_output_weights=False, num_query_groups=None)


def moe_config(model=None, layers: int = 2, gbs: int = 8, mbs: int = 2, dispatcher: str = "alltoall",
               tp: int = 1, pp: int = 1, vp: int = 1, schedule: str = None, ep: int = 1, etp: int = None,
               optim=None) -> Config:
    """The tiny Llama-style MoE model of every case on one layout (ep 1, tp 1, pp 1: one process)."""
    cfg = tiny_config({**LLAMA_STYLE, **MOE, **(model or {})}, gbs=gbs, mbs=mbs, num_layers=layers,
                      schedule=schedule, tp=tp, pp=pp, vp=vp)
    return cfg.with_(parallel=replace(cfg.parallel, ep=ep, etp=etp, moe_token_dispatcher_type=dispatcher,
                                      sequence_parallel=tp > 1),
                     optim=replace(cfg.optim, **(optim or {})))


def one_process(cfg: Config) -> Config:
    """``cfg`` on one process: the reference of every layout of the same model and batch."""
    return cfg.with_(parallel=replace(cfg.parallel, tp=1, pp=1, vp=1, cp=1, ep=1, etp=None, pipeline_schedule=None,
                                      sequence_parallel=False),
                     optim=replace(cfg.optim, use_distributed_optimizer=False))


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


def _run(world: int, cases, **grid) -> None:
    """Run the (name, layout cfg) ``cases`` on one rank grid; each against its one-process run."""
    refs = [reference(cfg) for _, cfg in cases]
    results = run_distributed(train_variants, world, [(cfg, ref["state"]) for (_, cfg), ref in zip(cases, refs)],
                              **grid)
    for i, ((name, _), ref) in enumerate(zip(cases, refs)):
        assert_matches([r[i] for r in results], ref, name)
    return results


def test_reference_drops_tokens_and_balances():
    """The references exercise what the layouts compare: capacity drops change the run, and the
    expert bias moves (sigmoid router, DeepSeek-V3 balancing)."""
    dropless, dropping = reference(moe_config()), reference(moe_config(CAPACITY))
    assert dropping["losses"][0] != dropless["losses"][0]
    feat = reference(moe_config(FEATURES, layers=4, gbs=8, mbs=1))
    bias = [v for k, v in feat["state"].items() if k.endswith("router.expert_bias")]
    assert bias and any(float(b.abs().max()) > 0 for b in bias)  # +rate then -rate may cancel in a layer


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ep2_dp2_alltoall_capacity_allgather():
    _run(4, [("ep2 x dp2 alltoall", moe_config(ep=2)),
             ("ep2 x dp2 alltoall capacity 0.5", moe_config(CAPACITY, ep=2)),
             ("ep2 x dp2 allgather", moe_config(ep=2, dispatcher="allgather"))], ep=2)


@pytest.mark.multiprocess
@pytest.mark.parametrize("etp,dispatcher", [(1, "alltoall"), (2, "allgather"), (2, "alltoall")])
def test_tp2_sp_ep2(etp, dispatcher):
    cases = [(f"tp2 x ep2 ETP {etp} {dispatcher}", moe_config(tp=2, ep=2, etp=etp, dispatcher=dispatcher))]
    if etp == 2 and dispatcher == "alltoall":  # GPT-2 style: expert biases (fc2's added by ETP rank 0), GeLU
        cases.append(("tp2 x ep2 ETP 2 gpt2-style", moe_config(GPT2_STYLE, tp=2, ep=2, etp=2, dispatcher=dispatcher)))
    _run(4, cases, tp=2, ep=2, etp=etp)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pp2_ep2_interleaved_and_zbv():
    cases = [(f"pp2 x ep2 {s}", moe_config(layers=4, gbs=8, mbs=2, pp=2, vp=2, schedule=s, ep=2))
             for s in ("interleaved_1f1b", "zbv")]
    # DualPipeV with its F/B pairs side by side (the forward on its own thread and communicators)
    cfg = moe_config(layers=4, gbs=16, mbs=2, pp=2, vp=2, schedule="dualpipev", ep=2)
    cases.append(("pp2 x ep2 dualpipev overlapped pairs",
                  cfg.with_(parallel=replace(cfg.parallel, overlap_moe_expert_parallel_comm=True))))
    # a stage without any MoE layer still joins every collective the MoE stage makes (grad norm, statistics)
    cases.append(("pp2 x ep2 1f1b, MoE layers on the last stage only",
                  moe_config({"moe_layer_freq": (0, 0, 1, 1)}, layers=4, gbs=8, mbs=2, pp=2, schedule="1f1b", ep=2)))
    results = _run(4, cases, pp=2, ep=2)
    assert all(r[2]["paired"] > 0 for r in results), [r[2]["paired"] for r in results]
    assert all(r[0]["paired"] == 0 for r in results)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_tp2_pp2_ep2_distributed_optimizer_expert_bias_shared_experts():
    cfg = moe_config(FEATURES, layers=4, gbs=8, mbs=1, tp=2, pp=2, ep=2, etp=1, schedule="1f1b",
                     optim={"use_distributed_optimizer": True})
    paired = moe_config(layers=4, gbs=8, mbs=1, tp=2, pp=2, vp=2, ep=2, etp=1, schedule="dualpipev",
                        dispatcher="allgather")  # TP (SP) and EP collectives on the forward's own communicators
    paired = paired.with_(parallel=replace(paired.parallel, overlap_moe_expert_parallel_comm=True))
    results = _run(8, [("tp2 x pp2 x ep2 distopt, expert bias, shared experts", cfg),
                       ("tp2 x pp2 x ep2 dualpipev overlapped pairs", paired)], tp=2, pp=2, ep=2, etp=1)
    assert all(r[1]["paired"] > 0 for r in results)


def test_expert_weight_gemms_wait_for_w():
    """Under a split backward (zero-bubble B) the expert linears leave their weight GEMMs to W,
    as the dense ones do; W then gives the plain backward's gradients."""
    cfg = moe_config(layers=1)
    torch.manual_seed(0)
    tokens = torch.randint(0, 250, (2, 16))
    grads = []
    for split in (False, True):
        trainer = Trainer(cfg, ParallelState.single())
        model = trainer.chunks[0]
        experts = {id(p): n for n, p in model.named_parameters() if getattr(p, "expert_parallel", False)}
        assert experts
        for p in model.parameters():
            p.grad = None
        if split:  # before the forward: the graph it builds decides where the weight GEMMs go
            enable_weight_grad_split(model)
        loss = model.loss(model(tokens), tokens, torch.ones_like(tokens, dtype=torch.float))
        if split:
            store = WeightGradStore()
            with store.collecting():
                loss.backward()
            deferred = {id(w) for w, *_ in store.pending}
            missing = [n for i, n in experts.items() if i not in deferred]
            assert not missing, f"expert weights not deferred to W: {missing}"
            for n, p in model.named_parameters():
                if id(p) in experts:
                    assert p.grad is None or not p.grad.any(), f"{n} got its gradient in B"
            store.run()
        else:
            loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if id(p) in experts})
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-6, atol=1e-7, msg=n)


@pytest.mark.multiprocess
def test_cp2_ep2_alltoall_and_sequence_aux_loss():
    """Context parallelism beside experts: the CP ranks' tokens are routed separately (their balancing
    loss parts add up over tp x cp), here with the global and the per-sequence balancing loss."""
    cases = []
    for model, dispatcher in (({}, "alltoall"), ({"moe_router_load_balancing_type": "seq_aux_loss"}, "allgather")):
        cfg = moe_config(model, ep=2, dispatcher=dispatcher)
        cases.append((f"cp2 x ep2 {dispatcher} {model}", cfg.with_(parallel=replace(cfg.parallel, cp=2))))
    _run(4, cases, cp=2, ep=2)
