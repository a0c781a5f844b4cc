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

from tests.helpers.moe_parity import (
    CAPACITY,
    FEATURES,
    GPT2_STYLE,
    assert_matches,
    moe_config,
    reference,
    train_variants,
)


def _run(run_distributed, world: int, cases, **grid) -> None:
    """Run the (name, layout cfg) ``cases`` on one rank grid; each against its one-process run."""
    refs = [reference(cfg) for _, cfg in cases]
    results = run_distributed(
        train_variants, world, [(cfg, ref["state"]) for (_, cfg), ref in zip(cases, refs)], **grid
    )
    for i, ((name, _), ref) in enumerate(zip(cases, refs)):
        assert_matches([r[i] for r in results], ref, name)
    return results


@pytest.mark.slow
def test_ep2_dp2_alltoall_capacity_allgather(run_distributed):
    _run(
        run_distributed,
        4,
        [
            ("ep2 x dp2 alltoall", moe_config(ep=2)),
            ("ep2 x dp2 alltoall capacity 0.5", moe_config(CAPACITY, ep=2)),
            ("ep2 x dp2 allgather", moe_config(ep=2, dispatcher="allgather")),
        ],
        ep=2,
    )


@pytest.mark.parametrize("etp,dispatcher", [(1, "alltoall"), (2, "allgather"), (2, "alltoall")])
def test_tp2_sp_ep2(etp, dispatcher, run_distributed):
    cases = [(f"tp2 x ep2 ETP {etp} {dispatcher}", moe_config(tp=2, ep=2, etp=etp, dispatcher=dispatcher))]
    if etp == 2 and dispatcher == "alltoall":  # GPT-2 style: expert biases (fc2's added by ETP rank 0), GeLU
        cases.append(("tp2 x ep2 ETP 2 gpt2-style", moe_config(GPT2_STYLE, tp=2, ep=2, etp=2, dispatcher=dispatcher)))
    _run(run_distributed, 4, cases, tp=2, ep=2, etp=etp)


@pytest.mark.slow
def test_pp2_ep2_interleaved_and_zbv(run_distributed):
    cases = [
        (f"pp2 x ep2 {s}", moe_config(layers=4, gbs=8, mbs=2, pp=2, vp=2, schedule=s, ep=2))
        for s in ("interleaved_1f1b", "zbv")
    ]
    # DualPipeV with its F/B pairs side by side (the forward on its own thread and communicators)
    cfg = moe_config(layers=4, gbs=16, mbs=2, pp=2, vp=2, schedule="dualpipev", ep=2)
    cases.append(
        (
            "pp2 x ep2 dualpipev overlapped pairs",
            cfg.with_(parallel=replace(cfg.parallel, overlap_moe_expert_parallel_comm=True)),
        )
    )
    # a stage without any MoE layer still joins every collective the MoE stage makes (grad norm, statistics)
    cases.append(
        (
            "pp2 x ep2 1f1b, MoE layers on the last stage only",
            moe_config({"moe_layer_freq": (0, 0, 1, 1)}, layers=4, gbs=8, mbs=2, pp=2, schedule="1f1b", ep=2),
        )
    )
    results = _run(run_distributed, 4, cases, pp=2, ep=2)
    assert all(r[2]["paired"] > 0 for r in results), [r[2]["paired"] for r in results]
    assert all(r[0]["paired"] == 0 for r in results)


@pytest.mark.slow
def test_tp2_pp2_ep2_distributed_optimizer_expert_bias_shared_experts(run_distributed):
    cfg = moe_config(
        FEATURES,
        layers=4,
        gbs=8,
        mbs=1,
        tp=2,
        pp=2,
        ep=2,
        etp=1,
        schedule="1f1b",
        optim={"use_distributed_optimizer": True},
    )
    paired = moe_config(
        layers=4, gbs=8, mbs=1, tp=2, pp=2, vp=2, ep=2, etp=1, schedule="dualpipev", dispatcher="allgather"
    )  # TP (SP) and EP collectives on the forward's own communicators
    paired = paired.with_(parallel=replace(paired.parallel, overlap_moe_expert_parallel_comm=True))
    results = _run(
        run_distributed,
        8,
        [
            ("tp2 x pp2 x ep2 distopt, expert bias, shared experts", cfg),
            ("tp2 x pp2 x ep2 dualpipev overlapped pairs", paired),
        ],
        tp=2,
        pp=2,
        ep=2,
        etp=1,
    )
    assert all(r[1]["paired"] > 0 for r in results)


def test_cp2_ep2_alltoall_and_sequence_aux_loss(run_distributed):
    """Context parallelism beside experts: the CP ranks' tokens are routed separately (their balancing
    loss parts add up over tp x cp), here with the global and the per-sequence balancing loss."""
    cases = []
    for model, dispatcher in (({}, "alltoall"), ({"moe_router_load_balancing_type": "seq_aux_loss"}, "allgather")):
        cfg = moe_config(model, ep=2, dispatcher=dispatcher)
        cases.append((f"cp2 x ep2 {dispatcher} {model}", cfg.with_(parallel=replace(cfg.parallel, cp=2))))
    _run(run_distributed, 4, cases, cp=2, ep=2)
