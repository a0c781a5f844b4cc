"""Mixture-of-experts pieces on one process: flags and their errors, the expert rank grid against
megatron-core's RankGenerator, routing and balancing losses against megatron-core's functions,
token dropping, the MoE block against a token-by-token computation, expert-bias balancing,
recomputation and half precision."""

from dataclasses import replace

import pytest
import torch

from megalite.config import ConfigError
from megalite.config.arguments import parse_args
from megalite.config.moe import layer_freq
from megalite.moe import moe_layers, update_expert_bias
from megalite.moe.experts import _activation
from megalite.moe.metrics import reduce_moe_stats
from megalite.parallel.state import ParallelState, expert_grid_groups
from megalite.training import Trainer
from megalite.training.mock import MockFeed
from tests.helpers.moe_parity import moe_cfg

MOE = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, moe_ffn_hidden_size=48)
BASE = [
    "--mock-data",
    "--num-layers",
    "4",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
]


def test_layer_freq_parses_megatron_patterns_and_nothing_else():
    assert layer_freq("([0]*1+[1]*3)") == (0, 1, 1, 1)
    assert layer_freq("[1,0]*2") == (1, 0, 1, 0)
    assert layer_freq("2") == 2
    for bad in ("__import__('os').system('true')", "[2, 1]", "0", "[]", "x"):
        with pytest.raises(Exception, match="--moe-layer-freq"):
            layer_freq(bad)
    cfg = parse_args(BASE + ["--num-experts", "4", "--moe-layer-freq", "([0]*1+[1]*3)"], world_size=1)
    assert [cfg.model.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert cfg.model.num_moe_layers == 3


@pytest.mark.parametrize(
    "flags,world,needle",
    [
        (
            ["--num-experts", "6", "--expert-model-parallel-size", "4"],
            4,
            "--num-experts 6 is not divisible by --expert-model-parallel-size 4",
        ),
        (["--num-experts", "8", "--expert-model-parallel-size", "4"], 2, "does not divide the 2 ranks"),
        (["--num-experts", "4", "--moe-router-topk", "5"], 1, "--moe-router-topk 5 is more than --num-experts 4"),
        (["--num-experts", "4", "--moe-expert-capacity-factor", "0"], 1, "--moe-expert-capacity-factor must be > 0"),
        (["--num-experts", "4", "--moe-expert-capacity-factor", "-1"], 1, "--moe-expert-capacity-factor must be > 0"),
        (["--moe-router-topk", "4"], 1, "--moe-router-topk is a mixture-of-experts flag but --num-experts is not set"),
        (["--expert-model-parallel-size", "2"], 2, "--expert-model-parallel-size is a mixture-of-experts flag"),
        (["--num-experts", "4", "--tensor-model-parallel-size", "2"], 2, "needs --sequence-parallel"),
        (["--num-experts", "4", "--moe-layer-freq", "[1,0]"], 1, "--moe-layer-freq lists 2 layers"),
        (["--num-experts", "4", "--moe-shared-expert-gate"], 1, "--moe-shared-expert-gate needs"),
        (["--num-experts", "4", "--moe-router-score-function", "tanh"], 1, "--moe-router-score-function"),
        (["--num-experts", "4", "--moe-router-enable-expert-bias"], 1, "needs --moe-router-score-function sigmoid"),
        (["--num-experts", "4", "--overlap-moe-expert-parallel-comm"], 1, "add --pipeline-schedule dualpipev"),
        (["--num-experts", "4", "--moe-expert-capacity-factor", "nan"], 1, "--moe-expert-capacity-factor must be > 0"),
        (["--num-experts", "4", "--moe-expert-capacity-factor", "inf"], 1, "--moe-expert-capacity-factor must be > 0"),
        (["--num-experts", "4", "--moe-layer-freq", "[1]*99999999999999999999"], 1, "--moe-layer-freq expects"),
        (["--moe-token-dispatcher-type", "alltoall"], 1, "--moe-token-dispatcher-type is a mixture-of-experts flag"),
        (["--moe-per-layer-logging"], 1, "--moe-per-layer-logging is a mixture-of-experts flag"),
        (
            ["--num-experts", "4", "--moe-token-drop-policy", "position"],
            1,
            "has no effect without --moe-expert-capacity",
        ),
        (["--num-experts", "4", "--moe-router-bias-update-rate", "0.1"], 1, "without --moe-router-enable-expert-bias"),
        (
            ["--num-experts", "4", "--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0.1"],
            1,
            "--moe-aux-loss-coeff has no effect",
        ),
        (
            ["--num-experts", "4", "--moe-router-score-function", "sigmoid", "--moe-router-pre-softmax"],
            1,
            "--moe-router-pre-softmax has no effect",
        ),
        (
            [
                "--num-experts",
                "4",
                "--overlap-moe-expert-parallel-comm",
                "--pipeline-schedule",
                "dualpipev",
                "--pipeline-model-parallel-size",
                "2",
                "--virtual-pipeline-model-parallel-size",
                "2",
            ],
            2,
            "set --hidden-dropout 0 --attention-dropout 0",
        ),
        (
            ["--num-experts", "4", "--expert-tensor-parallel-size", "2", "--ckpt-format", "torch", "--save", "/tmp/x"],
            2,
            "use --ckpt-format sharded",
        ),
    ],
)
def test_bad_moe_flags_are_one_line_errors(flags, world, needle):
    with pytest.raises(ConfigError) as e:
        parse_args(BASE + flags, world_size=world)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "world,tp,pp,cp,ep,etp",
    [(8, 2, 2, 1, 2, 1), (16, 2, 2, 2, 2, 2), (16, 4, 1, 1, 4, 2), (8, 1, 2, 2, 4, 1), (32, 2, 2, 2, 4, 1)],
)
def test_expert_grid_equals_megatron_core(world, tp, pp, cp, ep, etp):
    pytest.importorskip("megatron.core")
    from megatron.core.parallel_state import RankGenerator

    edp = world // pp // (ep * etp)
    gen = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order="tp-ep-dp-pp")
    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp * cp), pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    ours = expert_grid_groups(world, tp, pp, cp, ep, etp)

    def same(a, b):
        return sorted(map(sorted, a)) == sorted(map(sorted, b))

    assert same(ours["ep"], gen.get_ranks("ep")) and same(ours["etp"], gen.get_ranks("tp"))
    assert same(ours["edp"], gen.get_ranks("dp")) and same(ours["expert_mp"], gen.get_ranks("tp-ep"))
    assert same(ours["tp_cp"], dense.get_ranks("tp-cp"))


def _router(model=None):
    trainer = Trainer(moe_cfg(model), ParallelState.single())
    return trainer, moe_layers(trainer.chunks)[0]


@pytest.mark.parametrize(
    "score,pre,bias",
    [("softmax", False, False), ("softmax", True, False), ("sigmoid", False, True), ("sigmoid", False, False)],
)
def test_routing_equals_megatron_core(score, pre, bias):
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    torch.manual_seed(0)
    logits = torch.randn(40, 4)
    _, layer = _router(
        {"moe_router_score_function": score, "moe_router_pre_softmax": pre, "moe_router_enable_expert_bias": bias}
    )
    r = layer.router
    if bias:
        r.expert_bias.data = torch.tensor([0.3, -0.2, 0.0, 0.1])
    idx, top, _ = r._scores(logits)
    ours = torch.zeros_like(logits).scatter(1, idx, top)
    probs, routing = topk_routing_with_score_function(
        logits, 2, use_pre_softmax=pre, score_function=score, expert_bias=r.expert_bias
    )
    assert torch.equal(ours != 0, routing)
    torch.testing.assert_close(ours, probs.float(), rtol=1e-6, atol=1e-7)


def test_balancing_losses_equal_megatron_core():
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func, z_loss_func

    torch.manual_seed(1)
    s, b, E, k = 8, 3, 4, 2
    logits = torch.randn(s * b, E)
    _, layer = _router()
    r = layer.router
    idx, _, scores = r._scores(logits)
    routing = torch.zeros(s * b, E, dtype=torch.bool).scatter(1, idx, True)
    ref = switch_load_balancing_loss_func(scores, routing.sum(0), s * b, k, E, 1.0)
    torch.testing.assert_close(r._aux_loss(scores, idx, (s, b)), ref)
    torch.testing.assert_close(torch.logsumexp(logits, -1).square().mean(), z_loss_func(logits, 1.0))
    r.cfg = replace(r.cfg, moe_router_load_balancing_type="seq_aux_loss")  # megatron-core: [s, b*E] per sequence
    seq = switch_load_balancing_loss_func(scores.reshape(s, b * E), routing.reshape(s, b * E).sum(0), s, k, E, 1.0) / b
    torch.testing.assert_close(r._aux_loss(scores, idx, (s, b)), seq)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_drops_as_megatron_core(policy):
    mc = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    torch.manual_seed(2)
    _, layer = _router({"moe_expert_capacity_factor": 0.5, "moe_token_drop_policy": policy})
    logits = torch.randn(32, 4)
    idx, top, _ = layer.router._scores(logits)
    routing = torch.zeros(32, 4, dtype=torch.bool).scatter(1, idx, True)
    probs = torch.zeros(32, 4).scatter(1, idx, top)
    kept, kept_probs = layer.router._drop(routing, probs)
    assert kept.sum(0).max() == 8 and kept.sum() < routing.sum()  # capacity ceil(32 x 2 / 4 x 0.5) = 8
    ref_probs, ref_map = mc.apply_router_token_dropping(probs, routing, 2, 0.5, drop_policy=policy)
    if policy == "probs":
        assert torch.equal(kept, ref_map) and torch.equal(kept_probs, ref_probs)
    else:  # the first positions routed to each expert (megatron-core leaves ties to torch.topk)
        for e in range(4):
            rows = routing[:, e].nonzero().flatten()
            assert kept[:, e].nonzero().flatten().tolist() == rows[:8].tolist()


def test_moe_block_equals_token_by_token_computation():
    """The dispatch (permute, experts, combine) gives sum_k p_k expert_k(x) for every token."""
    trainer, layer = _router({"moe_shared_expert_intermediate_size": 32, "moe_shared_expert_gate": True})
    torch.manual_seed(3)
    x = torch.randn(6, 2, 32)
    out = layer(x)
    tokens = x.reshape(12, 32)
    routing, probs = layer.router(tokens, (6, 2), None)
    ref = torch.zeros_like(tokens)
    for t in range(12):
        for e in routing[t].nonzero().flatten().tolist():
            ex = layer.experts.local_experts[str(e)]
            h = _activation(ex.spec, tokens[t] @ ex.linear_fc1.weight.t())
            ref[t] += probs[t, e] * (h @ ex.linear_fc2.weight.t())
    ref = ref.view(6, 2, 32) + layer.shared_experts(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_expert_bias_moves_toward_equal_loads():
    trainer, layer = _router(
        {
            "moe_router_enable_expert_bias": True,
            "moe_router_score_function": "sigmoid",
            "moe_router_bias_update_rate": 0.01,
        }
    )
    layer.router.local_tokens_per_expert = torch.tensor([10.0, 2.0, 4.0, 4.0])  # mean 5
    update_expert_bias(trainer.chunks, trainer.ps)
    assert layer.router.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])
    assert layer.router.local_tokens_per_expert.sum() == 0 and layer.router.expert_bias.dtype == torch.float32


def _steps(cfg, steps=2):
    trainer = Trainer(cfg, ParallelState.single())
    feed = MockFeed(trainer, steps)
    out = []
    for _ in range(steps):
        step = trainer.train_step(feed.next())
        stats = reduce_moe_stats(moe_layers(trainer.chunks), trainer.ps, trainer.m)
        for layer in moe_layers(trainer.chunks):
            layer.reset_stats()
        out.append((step["loss"], step["grad_norm"], stats))
    return out


def test_full_recompute_counts_routing_once_and_changes_nothing():
    plain = _steps(moe_cfg())
    cfg = moe_cfg({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1})
    for (l1, n1, s1), (l2, n2, s2) in zip(plain, _steps(cfg)):
        assert l1 == pytest.approx(l2, rel=1e-6) and n1 == pytest.approx(n2, rel=1e-6)
        assert s1 == pytest.approx(s2, rel=1e-6)
    assert plain[0][2]["tokens_per_expert_mean"] == 8 * 16 * 2 / 4  # gbs x seq x topk / experts


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_moe_trains(dtype):
    cfg = moe_cfg(
        {"params_dtype": dtype, "moe_router_enable_expert_bias": True, "moe_router_score_function": "sigmoid"}
    )
    steps = _steps(cfg, 3)
    assert all(torch.isfinite(torch.tensor(loss)) for loss, _, _ in steps)
    trainer = Trainer(cfg, ParallelState.single())
    layer = moe_layers(trainer.chunks)[0]
    assert layer.router.expert_bias.dtype == torch.float32
    assert layer.experts.local_experts["0"].linear_fc1.weight.dtype == getattr(torch, dtype)


def test_balancing_loss_counts_the_unbiased_choices():
    """The expert bias steers which experts compute, never what the balancing loss counts (megatron-core
    counts the top-k of the unbiased scores): a large bias leaves the logged loss unchanged."""
    _, layer = _router(
        {
            "moe_router_enable_expert_bias": True,
            "moe_router_score_function": "sigmoid",
            "moe_router_load_balancing_type": "seq_aux_loss",
        }
    )
    torch.manual_seed(4)
    x = torch.randn(12, 32)
    losses = []
    for bias in ([0.0, 0.0, 0.0, 0.0], [5.0, 0.0, 0.0, 0.0]):
        layer.router.expert_bias.data = torch.tensor(bias)
        got = {}
        routing, _ = layer.router(x, (6, 2), lambda name, value: got.setdefault(name, value))
        losses.append(got["seq_load_balancing_loss"])
    assert routing[:, 0].all()  # the bias did steer every token to expert 0
    torch.testing.assert_close(losses[0], losses[1])


def test_aux_loss_scale_is_held_by_each_runs_routers():
    """The executor sets its own routers' aux-loss scale (loss scale / micro-batches, x cp) each step;
    another run's routers in the same process keep theirs (no process-wide scale)."""
    from megalite.moe import routers_of

    first, second = (Trainer(moe_cfg(), ParallelState.single()) for _ in range(2))
    routers = routers_of(first.chunks)
    assert len(routers) == 2 and all(r.aux_loss_scale == 1.0 for r in routers)
    first.train_step(MockFeed(first, 1).next())
    assert [r.aux_loss_scale for r in routers] == [1.0 / first.m] * 2 and first.m == 4
    assert all(r.aux_loss_scale == 1.0 for r in routers_of(second.chunks))
