"""Hugging Face ``GPT2LMHeadModel``, ``LlamaForCausalLM`` (and, through hf_moe.py, ``MixtralForCausalLM`` and
``Qwen2MoeForCausalLM``) folders as a conversion source and target.

A folder holds ``config.json`` and ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``). The tensor names and layouts that differ::

    GPT-2   transformer.h.N.attn.c_attn.weight [h, 3h]   Conv1D: the transpose of linear_qkv ([Q; K; V])
            c_proj, mlp.c_fc, mlp.c_proj                 Conv1D (transposed) as well; lm_head tied to wte
    Llama   model.layers.N.self_attn.{q,k,v}_proj        the Q, K, V row blocks of linear_qkv
            mlp.{gate,up}_proj                           the two halves of linear_fc1 ([gate; up])

Rotary embeddings need no permutation: megalite, Megatron-Core and HF's
Llama all rotate halves (``rotate_half``), not interleaved pairs. The
vocabulary is stored unpadded. The safetensors file is written as a stream:
its header is computed from the config first, then each layer's bytes are
appended, so memory holds one layer.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import BinaryIO, Dict, List, Tuple

import torch

from megalite.checkpointing.safe_load import CheckpointError
from megalite.config import ModelConfig
from megalite.interop.hf_moe import (
    MODEL_TYPES,
    MOE_ARCHS,
    QWEN2_MOE,
    check_zero_qkv_bias,
    fused_expert_reader,
    moe_config,
    moe_fields,
)
from megalite.interop.interchange import (
    ModelSource,
    SourceInfo,
    check_tensors,
    full_shape,
    layer_names,
    post_names,
    pre_names,
)
from megalite.model.spec import GPT2, LLAMA, ModelSpec, SpecError, hf_architecture, hf_layer_map, hf_top_map

# a tokenizer's files; generation_config.json (which every save_pretrained writes) is not one of them
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
# the files that hold a vocabulary: without one of these sets there is no tokenizer to record
_VOCAB_SETS = (("tokenizer.json",), ("vocab.json", "merges.txt"), ("tokenizer.model",))
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
# GPT-2's activation_function names (transformers' ACT2FN): the exact (erf) GeLU, and those that compute
# 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))), megalite's --openai-gelu; GPT2Config's default is "gelu_new"
_GELU_EXACT = ("gelu", "gelu_python")
_GELU_TANH = ("gelu_new", "gelu_fast", "gelu_pytorch_tanh", "gelu_python_tanh", "gelu_accurate")


def architecture_for(cfg: ModelConfig) -> str:
    """Which HF class can hold this model exactly; one line saying why none can."""
    try:
        return hf_architecture(ModelSpec.of(cfg))
    except SpecError as e:
        raise CheckpointError(str(e)) from None


# -- tensors: megalite (full, layer-relative) <-> HF, by the spec's name maps ---------------------
def to_hf_layer(cfg: ModelConfig, arch: str, i: int, t: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """One megalite layer's full tensors under HF names and layouts."""
    out = {}
    for m in hf_layer_map(ModelSpec.of(cfg), arch, i):
        if len(m.theirs) > 1:  # fused here, separate there: [Q; K; V], [gate; up]
            out.update(zip(m.theirs, t[m.ours].split(list(m.rows), dim=0)))
        else:
            out[m.theirs[0]] = t[m.ours].t().contiguous() if m.transpose else t[m.ours]
    return out


def from_hf_layer(cfg: ModelConfig, arch: str, i: int, get, has=lambda name: False) -> Dict[str, torch.Tensor]:
    """One layer in megalite's names from ``get(hf name)`` (``has(hf name)``: whether the files hold it)."""
    if cfg.is_moe_layer(i):  # transformers 5's fused expert layout is read too
        get = fused_expert_reader(arch, i, get, has)
    out = {}
    for m in hf_layer_map(ModelSpec.of(cfg), arch, i):
        if len(m.theirs) > 1:
            out[m.ours] = torch.cat([get(n) for n in m.theirs], dim=0)
        else:
            out[m.ours] = get(m.theirs[0]).t().contiguous() if m.transpose else get(m.theirs[0])
    return out


# -- config.json ----------------------------------------------------------------------------------
def hf_config(cfg: ModelConfig, arch: str) -> dict:
    """config.json for ``cfg`` (the unpadded vocabulary; GPT-2's GeLU as megalite computes it)."""
    common = {
        "architectures": [arch],
        "vocab_size": cfg.vocab_size,
        "dtype": cfg.params_dtype,
        "tie_word_embeddings": cfg.tied_embeddings,
        "initializer_range": cfg.init_method_std,
        "use_cache": True,
        # GPT-2's default special ids (50256) do not exist in a smaller vocabulary
        **({"bos_token_id": None, "eos_token_id": None} if cfg.vocab_size <= 50256 else {}),
    }
    if arch == GPT2:
        return {
            **common,
            "model_type": "gpt2",
            "n_embd": cfg.hidden_size,
            "n_layer": cfg.num_layers,
            "n_head": cfg.num_attention_heads,
            "n_inner": cfg.ffn_size,
            "n_positions": cfg.max_positions,
            "n_ctx": cfg.max_positions,
            "layer_norm_epsilon": cfg.layernorm_epsilon,
            "activation_function": "gelu_new" if cfg.openai_gelu else "gelu",
            "resid_pdrop": cfg.hidden_dropout,
            "embd_pdrop": cfg.hidden_dropout,
            "attn_pdrop": cfg.attention_dropout,
            "scale_attn_weights": True,
        }
    out = {
        **common,
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.query_groups,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_positions,
        "rms_norm_eps": cfg.layernorm_epsilon,
        "rope_theta": float(cfg.rotary_base),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.rotary_base)},
        "attention_bias": cfg.add_bias_linear,
        "mlp_bias": cfg.add_bias_linear,
        "attention_dropout": cfg.attention_dropout,
    }
    if arch in MOE_ARCHS:
        del out["attention_bias"], out["mlp_bias"]
        out.update(moe_config(cfg, arch))
    return out


def _require(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise CheckpointError(f"{where}: {what}, which megalite's model does not have")


def config_from_hf(c: dict, where: str, divisible_by: int) -> Tuple[ModelConfig, str]:
    """megalite's ModelConfig (and the architecture) from an HF config.json."""
    arch = (c.get("architectures") or [""])[0]
    dtype = _DTYPE_NAMES.get(str(c.get("dtype") or c.get("torch_dtype") or "float32"), "float32")
    if arch == GPT2 or (not arch and c.get("model_type") == "gpt2"):
        _require(not c.get("scale_attn_by_inverse_layer_idx"), where, "scale_attn_by_inverse_layer_idx is set")
        _require(c.get("scale_attn_weights", True), where, "attention scores are not scaled")
        act = c.get("activation_function", "gelu_new")
        _require(act in _GELU_EXACT + _GELU_TANH, where, f"activation {act!r} is used")
        h = c["n_embd"]
        cfg = ModelConfig(
            num_layers=c["n_layer"],
            hidden_size=h,
            ffn_hidden_size=c.get("n_inner") or 4 * h,
            num_attention_heads=c["n_head"],
            seq_length=c["n_positions"],
            max_position_embeddings=c["n_positions"],
            vocab_size=c["vocab_size"],
            make_vocab_size_divisible_by=divisible_by,
            init_method_std=c.get("initializer_range", 0.02),
            hidden_dropout=c.get("resid_pdrop", 0.1),
            attention_dropout=c.get("attn_pdrop", 0.1),
            layernorm_epsilon=c.get("layer_norm_epsilon", 1e-5),
            untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", True),
            openai_gelu=act in _GELU_TANH,
            params_dtype=dtype,
        )
        return cfg, GPT2
    arch = arch or {"llama": LLAMA, **MODEL_TYPES}.get(c.get("model_type"), "")
    if arch in (LLAMA,) + MOE_ARCHS:
        h, heads = c["hidden_size"], c["num_attention_heads"]
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
        _require(
            rope.get("rope_type", rope.get("type", "default")) == "default",
            where,
            f"rope scaling {rope.get('rope_type', rope.get('type'))!r} is used",
        )
        _require((c.get("head_dim") or h // heads) == h // heads, where, "head_dim differs from hidden_size/heads")
        _require(c.get("hidden_act", "silu") == "silu", where, f"activation {c.get('hidden_act')!r} is used")
        _require(float(theta).is_integer(), where, f"rope_theta {theta} is not an integer")
        bias = bool(c.get("attention_bias", False))
        _require(bool(c.get("mlp_bias", False)) == bias, where, "attention and MLP biases differ")
        kv = c.get("num_key_value_heads") or heads
        moe = moe_fields(c, arch, where) if arch in MOE_ARCHS else {"ffn_hidden_size": c["intermediate_size"]}
        cfg = ModelConfig(
            num_layers=c["num_hidden_layers"],
            hidden_size=h,
            **moe,
            num_attention_heads=heads,
            num_query_groups=kv if kv != heads else None,
            seq_length=c["max_position_embeddings"],
            max_position_embeddings=c["max_position_embeddings"],
            vocab_size=c["vocab_size"],
            make_vocab_size_divisible_by=divisible_by,
            init_method_std=c.get("initializer_range", 0.02),
            hidden_dropout=0.0,
            attention_dropout=c.get("attention_dropout", 0.0),
            normalization="RMSNorm",
            layernorm_epsilon=c.get("rms_norm_eps", 1e-6),
            swiglu=True,
            position_embedding_type="rope",
            rotary_base=int(theta),
            add_bias_linear=bias,
            untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False),
            params_dtype=dtype,
        )
        return cfg, arch
    raise CheckpointError(
        f"{where} describes {arch or c.get('model_type') or 'an unknown model'}; the hf loader "
        f"reads {GPT2}, {LLAMA} and {', '.join(MOE_ARCHS)}"
    )


# -- tokenizer files ------------------------------------------------------------------------------
def find_tokenizer(root: str) -> List[str]:
    """The tokenizer files in an HF folder, or [] when none holds a vocabulary (a config alone is no tokenizer)."""
    present = {n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(root, n))}
    if not any(all(n in present for n in group) for group in _VOCAB_SETS):
        return []
    return [os.path.join(root, n) for n in TOKENIZER_FILES if n in present]


def tokenizer_fields(files: List[str], where: str) -> Dict[str, str]:
    """The tokenizer flags a megalite/Megatron run records for ``files`` (from :func:`find_tokenizer`) in ``where``.

    tokenizer.json -> HuggingFaceTokenizer (the ``tokenizers`` library reads it); vocab.json + merges.txt
    -> GPT2BPETokenizer when ``<|endoftext|>`` is its eod; tokenizer.model -> Llama2Tokenizer.
    """
    names = {os.path.basename(f) for f in files}
    if "tokenizer.json" not in names and {"vocab.json", "merges.txt"} <= names:
        try:
            with open(os.path.join(os.path.dirname(files[0]), "vocab.json"), encoding="utf-8") as f:
                gpt2 = "<|endoftext|>" in json.load(f)
        except (OSError, ValueError):
            gpt2 = False
        if gpt2:
            return {
                "tokenizer_type": "GPT2BPETokenizer",
                "vocab_file": os.path.join(where, "vocab.json"),
                "merge_file": os.path.join(where, "merges.txt"),
            }
    if "tokenizer.json" not in names and "tokenizer.model" in names:
        return {"tokenizer_type": "Llama2Tokenizer", "tokenizer_model": os.path.join(where, "tokenizer.model")}
    return {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": where}


# -- reading --------------------------------------------------------------------------------------
def _safe_open(safe_open, path: str):
    """``safe_open(path)``, with a damaged file (truncated, not safetensors) as one CheckpointError line."""
    from safetensors import SafetensorError

    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError) as e:  # the library's message names neither the file nor a remedy
        raise CheckpointError(
            f"{path} is not a complete safetensors file ({str(e).splitlines()[0]}); it may be "
            f"truncated (an interrupted download or copy): fetch it again"
        ) from None


class HFSource(ModelSource):
    """An HF model folder read tensor by tensor through ``safetensors.safe_open``."""

    def __init__(self, root: str, divisible_by: int = 128):
        from safetensors import safe_open

        path = os.path.join(root, "config.json")
        if not os.path.isdir(root):
            raise CheckpointError(f"--load-dir {root} does not exist")
        if not os.path.exists(path):
            raise CheckpointError(f"{root} has no config.json: it is not a Hugging Face model folder")
        try:
            with open(path) as f:
                raw = json.load(f)
        except ValueError as e:
            raise CheckpointError(f"cannot read {path}: {e}") from None
        self.cfg, self.arch = config_from_hf(raw, path, divisible_by)
        index = os.path.join(root, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = {n: os.path.join(root, fn) for n, fn in json.load(f)["weight_map"].items()}
        elif os.path.exists(os.path.join(root, "model.safetensors")):
            files = None
        else:
            raise CheckpointError(
                f"{root} has no model.safetensors (nor an index of shards); convert .bin weights to safetensors first"
            )
        self._handles: Dict[str, object] = {}
        self._open = lambda fn: (
            self._handles[fn] if fn in self._handles else self._handles.setdefault(fn, _safe_open(safe_open, fn))
        )  # each file opened once
        if files is None:
            single = os.path.join(root, "model.safetensors")
            files = {n: single for n in self._open(single).keys()}
        # GPT-2 files from the hub name tensors without the "transformer." prefix
        self._files = {
            ("transformer." + n if self.arch == GPT2 and not n.startswith(("transformer.", "lm_head")) else n): (fn, n)
            for n, fn in files.items()
        }
        self.info = SourceInfo(kind="hf", tokenizer_files=find_tokenizer(root))
        if self.arch == QWEN2_MOE and raw.get("qkv_bias", True):  # must be zero (hf_moe.py): checked up front
            for i in range(self.cfg.num_layers):
                check_zero_qkv_bias(self._get, i, "the HF weights")

    def _get(self, name: str) -> torch.Tensor:
        if name not in self._files:
            raise CheckpointError(f"the HF weights have no tensor {name!r}: they do not match config.json")
        fn, stored = self._files[name]
        return self._open(fn).get_tensor(stored).to(self.cfg.torch_dtype)

    def _top(self, names: List[str]) -> Dict[str, torch.Tensor]:
        m = hf_top_map(ModelSpec.of(self.cfg), self.arch)
        out = {n: self._get(m[n]) for n in names}
        check_tensors(self.cfg, out, names, "the HF weights")
        return out

    def pre(self) -> Dict[str, torch.Tensor]:
        return self._top(pre_names(self.cfg))

    def layer(self, i: int) -> Dict[str, torch.Tensor]:
        out = from_hf_layer(self.cfg, self.arch, i, self._get, lambda n: n in self._files)
        check_tensors(self.cfg, out, layer_names(self.cfg, i), f"the HF weights (layer {i})")
        return out

    def post(self) -> Dict[str, torch.Tensor]:
        return self._top(post_names(self.cfg))

    def close(self) -> None:
        self._handles.clear()


# -- writing --------------------------------------------------------------------------------------
class SafetensorsStream:
    """A safetensors file written front to back: the header from known shapes, then tensors in order."""

    def __init__(self, f: BinaryIO, entries: List[Tuple[str, Tuple[int, ...]]], dtype: torch.dtype):
        size = torch.tensor([], dtype=dtype).element_size()
        header, offset = {}, 0
        for name, shape in entries:
            n = math.prod(shape) * size
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the format aligns the data to 8 bytes
        f.write(struct.pack("<Q", len(raw)) + raw)
        self.f, self.dtype, self.order, self.shapes = f, dtype, [n for n, _ in entries], dict(entries)
        self.next = 0

    def write(self, name: str, t: torch.Tensor) -> None:
        if self.next >= len(self.order) or self.order[self.next] != name or tuple(t.shape) != self.shapes[name]:
            raise CheckpointError(f"internal error: {name} {tuple(t.shape)} written out of the header's order")
        self.f.write(t.to(self.dtype).contiguous().view(torch.uint8).numpy().tobytes())
        self.next += 1

    def close(self) -> None:
        if self.next != len(self.order):
            raise CheckpointError(f"internal error: {len(self.order) - self.next} tensors were not written")


def _hf_order(cfg: ModelConfig, arch: str) -> List[Tuple[str, Tuple[int, ...]]]:
    """(HF name, shape) of every tensor, in the order the stream produces them."""
    zero = lambda n: torch.empty(full_shape(cfg, n), device="meta")  # noqa: E731 - shapes only, no memory
    top = hf_top_map(ModelSpec.of(cfg), arch)
    out = [(top[n], full_shape(cfg, n)) for n in pre_names(cfg)]
    for i in range(cfg.num_layers):
        shaped = to_hf_layer(cfg, arch, i, {n: zero(n) for n in layer_names(cfg, i)})
        out += [(n, tuple(t.shape)) for n, t in shaped.items()]
    return out + [(top[n], full_shape(cfg, n)) for n in post_names(cfg)]


def save_hf(source: ModelSource, out: str, progress) -> None:
    """Write ``source`` as an HF folder (config.json + model.safetensors) under ``out`` (a fresh directory)."""
    cfg = source.cfg
    arch = architecture_for(cfg)
    os.makedirs(out)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_config(cfg, arch), f, indent=2)
    top = hf_top_map(ModelSpec.of(cfg), arch)
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        stream = SafetensorsStream(f, _hf_order(cfg, arch), cfg.torch_dtype)
        for n, t in source.pre().items():
            stream.write(top[n], t)
        progress("embeddings")
        for i in range(cfg.num_layers):
            for n, t in to_hf_layer(cfg, arch, i, source.layer(i)).items():
                stream.write(n, t)
            progress(f"layer {i}")
        for n, t in source.post().items():
            stream.write(top[n], t)
        progress("final norm and head")
        stream.close()
