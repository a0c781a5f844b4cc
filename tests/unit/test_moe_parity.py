"""The mixture-of-experts parity references in one process: capacity drops change the run and the expert
bias moves; under a split backward (zero-bubble B) the expert weight GEMMs wait for W. (The layouts against
these references: tests/distributed/test_moe_parity.py.)"""

import torch

from megalite.parallel.state import ParallelState
from megalite.tensor_parallel.layers import WeightGradStore, enable_weight_grad_split
from megalite.training import Trainer
from tests.helpers.moe_parity import CAPACITY, FEATURES, moe_config, reference


def test_reference_drops_tokens_and_balances():
    """The references exercise what the layouts compare: capacity drops change the run, and the
    expert bias moves (sigmoid router, DeepSeek-V3 balancing)."""
    dropless, dropping = reference(moe_config()), reference(moe_config(CAPACITY))
    assert dropping["losses"][0] != dropless["losses"][0]
    feat = reference(moe_config(FEATURES, layers=4, gbs=8, mbs=1))
    bias = [v for k, v in feat["state"].items() if k.endswith("router.expert_bias")]
    assert bias and any(float(b.abs().max()) > 0 for b in bias)  # +rate then -rate may cancel in a layer


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
            wgrad = enable_weight_grad_split(model)
        loss = model.loss(model(tokens), tokens, torch.ones_like(tokens, dtype=torch.float))
        if split:
            store = WeightGradStore()
            with wgrad.collecting(store):
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
