"""A trained checkpoint in one process: load any layout, tokenize, sample, generate.

::

    --load DIR  ->  meta.json: the run's Config (model shape, tokenizer, data, seed)
                ->  full tensors, whatever tp/pp/vp the run was saved with, read layer by
                    layer by the converter's reader (checkpointing/native_io.MegaliteSource)
                ->  GPTModel at tp = pp = 1 (vocabulary padding re-added for tp 1)

    generate:  prompt ids -> model(prompt, cache) -> sample -> model(new token, cache) -> ...
               until --max-new-tokens or eod; without a cache each step reruns the whole sequence.

Sampling follows Megatron's text generation: temperature, then top-k, then
top-p (nucleus) filtering, then one multinomial draw from a seeded generator
(so a seed gives the same text every time); greedy takes the argmax.
Used by tools/generate.py and tools/evaluate.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megalite.checkpointing import CheckpointError
from megalite.config import (
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)
from megalite.data.loading import resolve_default_corpus
from megalite.data.tokenizers import Tokenizer, build_tokenizer
from megalite.interop.native_io import MegaliteSource
from megalite.model.gpt import GPTModel
from megalite.model.kv_cache import KVCache
from megalite.parallel.state import ParallelState
from megalite.tensor_parallel.random import RNGTracker

_SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "optim": OptimConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
}


# -- checkpoint -> config and full tensors ---------------------------------------------------------
def config_from_dict(saved: dict) -> Config:
    """The run's Config from meta.json's ``config`` (fields this version lacks are ignored, new ones default)."""
    sections = {}
    for name, cls in _SECTIONS.items():
        known = {f.name for f in fields(cls)}
        values = {k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.get(name, {}).items() if k in known}
        sections[name] = cls(**values)
    return Config(**sections)


def read_checkpoint(root: str, step: Optional[int] = None) -> Tuple[Config, int, Dict[str, torch.Tensor]]:
    """(run config, iteration, full unsharded model tensors) of ``root``'s latest or ``step`` checkpoint."""
    source = MegaliteSource(root, step, flag="--load")
    try:
        cfg = config_from_dict(source.meta["config"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"cannot read {source.dir}/meta.json ({e}); the checkpoint is damaged") from None
    return cfg, source.info.iteration, source.full_model()


def build_model(
    cfg: Config, full: Dict[str, torch.Tensor], device: torch.device | str = "cpu", dtype: Optional[str] = None
) -> GPTModel:
    """A single-process GPTModel (eval mode, no dropout) holding ``full``'s weights, in ``dtype``."""
    model_cfg = replace(
        cfg.model,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        recompute_granularity=None,
        torch_compile=False,
        params_dtype=dtype or cfg.model.params_dtype,
    )
    ps = ParallelState.single(torch.device(device))
    model = GPTModel(model_cfg, ps, RNGTracker(cfg.train.seed, 0, 0, ps.device), cfg.train.seed).to(ps.device)
    load_full_weights(model, full)
    return model.eval()


def load_full_weights(model: GPTModel, full: Dict[str, torch.Tensor]) -> None:
    """Copy full (unsharded, unpadded) tensors into a tp = 1 model's parameters, checking every shape."""
    try:
        local = model.local_from_full(full)
    except KeyError as e:
        raise CheckpointError(f"the checkpoint has no tensor {e}; it was saved from another model") from None
    with torch.no_grad():
        for name, p in model.named_parameters():
            if tuple(local[name].shape) != tuple(p.shape):
                raise CheckpointError(
                    f"{name} is {tuple(local[name].shape)} in the checkpoint, {tuple(p.shape)} "
                    f"in the model its config describes; the checkpoint is damaged"
                )
            p.copy_(local[name])


# -- tokenizer -----------------------------------------------------------------------------------
def run_tokenizer(cfg: Config, overrides: Optional[dict] = None) -> Tokenizer:
    """The run's tokenizer: the checkpoint's tokenizer flags, each replaced by one given in ``overrides``.

    A run without one (--mock-data, a converted HF folder without tokenizer files) has its ids
    written as numbers (NullTokenizer). ``overrides["vocab_size"]`` is NullTokenizer's --vocab-size N
    (ids 0..N-1, eod N), at most the model's vocabulary; other tokenizers ignore it, as Megatron's do.
    """
    overrides = dict(overrides or {})
    given = overrides.pop("vocab_size", None)
    data = resolve_default_corpus(cfg.data)
    data = replace(data, **{k: v for k, v in overrides.items() if v is not None})
    vocab = cfg.model.vocab_size
    if given is not None and not 0 < given <= vocab:
        raise ValueError(f"--vocab-size {given} must be in [1, {vocab}]: the model has {vocab} ids")
    if not data.tokenizer_type:
        data = replace(data, tokenizer_type="NullTokenizer")
        return build_tokenizer(data, given or vocab)  # ids 0..vocab-1 (its eod, vocab, is never generated)
    # the run's vocabulary counts NullTokenizer's eod (Megatron's: --vocab-size N ids, eod N): N is one less
    return build_tokenizer(data, (given or vocab - 1) if data.tokenizer_type == "NullTokenizer" else vocab)


# -- sampling and generation ---------------------------------------------------------------------
@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy, or temperature, top-k (0: off), top-p (1.0: off)."""

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def check(self) -> "Sampling":
        """Raise a one-line ValueError for values sampling cannot use."""
        if not self.temperature >= 0 or math.isinf(self.temperature):
            raise ValueError(f"--temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0 (0 keeps every token), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top-p must be in (0, 1] (1 keeps every token), got {self.top_p}")
        return self


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """Choose one id from the last position's ``logits`` [V] (float32 on CPU)."""
    if sampling.greedy or sampling.temperature == 0.0:
        return int(logits.argmax())
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.numel():
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[torch.topk(logits, sampling.top_k).indices] = True
        logits = logits.masked_fill(~keep, float("-inf"))
    if sampling.top_p < 1.0:
        probs, order = torch.softmax(logits, dim=-1).sort(descending=True)
        # drop a token once the more likely ones already hold top_p (the most likely always stays)
        drop_sorted = probs.cumsum(0) - probs >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


@torch.no_grad()
def generate(
    model: GPTModel,
    prompt: Sequence[int],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    seed: int = 1234,
    eod: Optional[int] = None,
    use_kv_cache: bool = True,
) -> List[int]:
    """The ids that follow ``prompt`` (non-empty), ending with ``eod`` if it was generated.

    With ``use_kv_cache`` the prompt runs once and every later step runs only the
    new token; without it every step reruns the whole sequence (same tokens).
    """
    model.eval()
    device = next(model.parameters()).device
    vocab = model.cfg.vocab_size  # the padding rows are never sampled
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    cache = KVCache.for_model(model, 1, len(prompt) + max_new_tokens) if use_kv_cache else None
    step_input, out = tokens, []
    for _ in range(max_new_tokens):
        logits = model(step_input, kv_cache=cache)[-1, 0, :vocab]  # the last position's [V]
        token = next_token(logits.float().cpu(), sampling, generator)
        out.append(token)
        if token == eod:
            break
        new = torch.tensor([[token]], dtype=torch.long, device=device)
        tokens = torch.cat([tokens, new], dim=1)
        step_input = new if cache is not None else tokens
    return out
