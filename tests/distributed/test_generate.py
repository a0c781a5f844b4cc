"""A checkpoint saved at tp=2 x pp=2 (both formats, with virtual stages) generates in one process
exactly what the same weights generate at tp=1: the loaders place every shard where it belongs.

Initialization does not depend on the layout (README, Architecture: design rules), so a run saved at iteration 0 at
tp 2 x pp 2 holds the same weights as one process building the same config.
"""

from dataclasses import replace

import pytest
import torch

from megalite.config import CheckpointConfig
from megalite.inference import Sampling, build_model, generate, read_checkpoint
from megalite.parallel.state import ParallelState
from megalite.training import Trainer
from tests.helpers.parity import GPT2_STYLE, LLAMA_STYLE, tiny_config


def _cfg(style, tp=1, pp=1, vp=1):
    cfg = tiny_config(
        style, gbs=4, mbs=1, num_layers=4, tp=tp, pp=pp, vp=vp, schedule="interleaved_1f1b" if vp > 1 else None
    )
    return cfg.with_(model=replace(cfg.model, init_method_std=0.3, seq_length=32))  # peaked outputs


def _save(ps, cfg, root, fmt):
    trainer = Trainer(cfg.with_(checkpoint=CheckpointConfig(save=root, ckpt_format=fmt)), ps)
    trainer.checkpointer.save()
    return True


CASES = [("llama", 1, "sharded"), ("gpt2", 2, "torch"), ("llama", 2, "torch")]  # (style, vp, format)


@pytest.mark.parametrize("style,vp,fmt", CASES, ids=[f"{s}-vp{v}-{f}" for s, v, f in CASES])
def test_tp2_pp2_checkpoint_generates_the_single_process_tokens(tmp_path, style, vp, fmt, run_distributed):
    model_style = GPT2_STYLE if style == "gpt2" else LLAMA_STYLE
    root = str(tmp_path / "ck")
    run_distributed(_save, 4, _cfg(model_style, tp=2, pp=2, vp=vp), root, fmt, tp=2, pp=2)
    reference = Trainer(_cfg(model_style), ParallelState.single()).chunks[0]
    cfg, it, full = read_checkpoint(root)
    assert it == 0 and cfg.parallel.tp == 2 and cfg.parallel.pp == 2
    loaded = build_model(cfg, full)
    for name, p in reference.named_parameters():  # every shard in its place (padding rows aside)
        rows = (
            min(p.shape[0], cfg.model.vocab_size) if "word_embeddings" in name or "output_layer" in name else p.shape[0]
        )
        assert torch.equal(dict(loaded.named_parameters())[name][:rows], p.detach()[:rows]), name
    reference.eval()
    prompt = [3, 14, 15, 92]
    for sampling in (Sampling(greedy=True), Sampling(temperature=1.0, top_p=0.9)):
        want = generate(reference, prompt, 20, sampling, seed=5)
        assert generate(loaded, prompt, 20, sampling, seed=5) == want
        assert generate(loaded, prompt, 20, sampling, seed=5, use_kv_cache=False) == want
