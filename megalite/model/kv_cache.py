"""Keys and values of the tokens already seen, so each decoding step runs one new token.

Without a cache, step t of generation recomputes attention over all t tokens in
every layer (O(t^2) work per step). With it, every attention layer keeps its
keys and values in a buffer allocated once for ``max_len`` positions::

    per attention layer:  k, v  [b, nkv/tp, max_len, d]     (positions 0 .. seq_len-1 filled)
    step: new tokens [b, s] at positions seq_len .. seq_len+s-1
          -> each layer writes its new k, v and attends over positions 0 .. seq_len+s-1
          -> the model advances seq_len by s

Only the query groups' keys and values are stored (grouped-query attention's
memory saving); the attention broadcasts them over the query heads. Keys are
stored after RoPE, so a cached key never needs rotating again.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch
from torch import nn


class KVCache:
    """Per-layer key/value buffers for ``batch`` sequences of up to ``max_len`` tokens."""

    def __init__(
        self,
        batch: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        self.shape = (batch, num_kv_heads, max_len, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.seq_len = 0  # positions already cached: the next token's position
        self._buffers: Dict[nn.Module, Tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def for_model(cls, model: nn.Module, batch: int, max_len: int) -> "KVCache":
        """A cache sized for ``model`` (a GPTModel chunk; its local query groups and dtype)."""
        cfg = model.cfg
        weight = next(model.parameters())
        return cls(batch, max_len, cfg.query_groups // model.tp.size, cfg.head_dim, weight.dtype, weight.device)

    @property
    def max_len(self) -> int:
        return self.shape[2]

    def append(self, layer: nn.Module, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Store ``layer``'s new k, v [b, nkv, s, d] after the cached ones; return all of them [b, nkv, len+s, d].

        ``seq_len`` is not advanced here (every layer of a step writes at the same
        positions); the model calls :meth:`advance` once the step's layers have run.
        """
        end = self.seq_len + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; this step needs {end}")
        if layer not in self._buffers:
            self._buffers[layer] = (
                torch.zeros(self.shape, dtype=self.dtype, device=self.device),
                torch.zeros(self.shape, dtype=self.dtype, device=self.device),
            )
        k_buf, v_buf = self._buffers[layer]
        k_buf[:, :, self.seq_len : end] = k
        v_buf[:, :, self.seq_len : end] = v
        return k_buf[:, :, :end], v_buf[:, :, :end]

    def advance(self, n: int) -> None:
        """Mark ``n`` more positions as cached (after a step's layers have all appended)."""
        self.seq_len += n

    def nbytes(self) -> int:
        """Bytes held by the buffers allocated so far."""
        return sum(k.nbytes + v.nbytes for k, v in self._buffers.values())
