"""Where each token of a sequence lives under context parallelism, and packed documents.

Context parallelism (CP) splits every sequence of ``s`` tokens over the CP group. Causal attention
makes late tokens costlier than early ones, so the sequence is cut into 2 x CP chunks and CP rank r
keeps chunks r and 2CP-1-r (Megatron's and Llama 3's load balance; every rank then does the same
attention work)::

    s = 16, CP = 2:  chunks  [0..3] [4..7] [8..11] [12..15]
                     rank 0: [0..3] + [12..15]      rank 1: [4..7] + [8..11]

Packed documents (Megatron's ``--reset-position-ids``, ``--reset-attention-mask``,
``--eod-mask-loss``; get_ltor_masks_and_position_ids' semantics): several documents share one
sample, each ending with the tokenizer's eod. A token belongs to the document its nearest eod at or
after it ends (the eod belongs to the document it closes)::

    tokens        a  b  EOD c  d  EOD e
    segment_ids   0  0  0   1  1  1   2     (eods strictly before the token)
    position_ids  0  1  2   0  1  2   0     (--reset-position-ids)
    loss_mask     1  1  0   1  1  0   1     (--eod-mask-loss: 0 where the input token is eod)

With --reset-attention-mask a token attends only earlier tokens of its own segment.
A micro-batch dict then carries ``position_ids`` [b, s_local] (absent: a token's global index),
``segment_ids`` [b, s] (FULL sequence on every CP rank; absent: one document per row) and, under
CP, ``num_tokens`` (the full sequence's loss-mask sum, for the loss normalisation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

Batch = Dict[str, torch.Tensor]
SLICED = ("tokens", "labels", "loss_mask", "position_ids")  # [b, s] fields cut to this rank's chunks


def cp_token_index(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global index of each of this CP rank's ``seq_len / cp_size`` tokens: chunks r and 2CP-1-r."""
    if cp_size == 1:
        return torch.arange(seq_len, device=device)
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x context-parallel-size ({2 * cp_size})")
    c = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device)
    last = torch.arange((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c, device=device)
    return torch.cat([first, last])


def document_info(tokens: torch.Tensor, eod: int) -> tuple:
    """(segment_ids, position_ids) of tokens [b, s]: eods strictly before each token, and the token's
    offset from the start of its document (positions restart after every eod)."""
    is_eod = (tokens == eod).long()
    segment_ids = is_eod.cumsum(dim=1) - is_eod
    s = tokens.shape[1]
    index = torch.arange(s, device=tokens.device).expand_as(tokens)
    # the first index of each token's document: one past the last eod strictly before it
    after_eod = torch.where(is_eod.bool(), index + 1, torch.zeros_like(index))
    start = torch.cummax(after_eod, dim=1).values
    start = torch.cat([torch.zeros_like(start[:, :1]), start[:, :-1]], dim=1)
    return segment_ids, index - start


@dataclass(frozen=True)
class SequenceOptions:
    """How a micro-batch's sequence is laid out: packing flags (need ``eod``) and this rank's CP place."""

    eod: Optional[int] = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    cp_size: int = 1
    cp_rank: int = 0

    @property
    def packing(self) -> bool:
        return self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss

    def build(self, tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> Batch:
        """The full-sequence micro-batch with the packing fields the flags ask for, then this rank's slice."""
        batch = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}
        if self.packing:
            batch = add_document_fields(
                batch, self.eod, self.reset_position_ids, self.reset_attention_mask, self.eod_mask_loss
            )
        return slice_for_cp(batch, self.cp_size, self.cp_rank) if self.cp_size > 1 else batch


def add_document_fields(
    batch: Batch, eod: int, reset_position_ids: bool, reset_attention_mask: bool, eod_mask_loss: bool
) -> Batch:
    """``batch`` with Megatron's packed-document fields: position_ids (reset after each eod),
    segment_ids (for the block-diagonal causal mask), loss_mask 0 at eod inputs."""
    out = dict(batch)
    tokens = batch["tokens"]
    segment_ids, positions = document_info(tokens, eod)
    if eod_mask_loss:
        out["loss_mask"] = batch["loss_mask"].masked_fill(tokens == eod, 0.0)
    if reset_position_ids:
        out["position_ids"] = positions
    if reset_attention_mask:
        out["segment_ids"] = segment_ids
    return out


def slice_for_cp(batch: Batch, cp_size: int, cp_rank: int) -> Batch:
    """This CP rank's part of a full-sequence micro-batch: the [b, s] fields cut to chunks r and
    2CP-1-r, ``segment_ids`` kept whole (attention needs the keys' documents), ``num_tokens`` the
    whole sequence's loss-mask sum (each rank's loss is normalised by the full count)."""
    s = batch["tokens"].shape[1]
    index = cp_token_index(s, cp_size, cp_rank, batch["tokens"].device)
    out = {k: (v.index_select(1, index) if k in SLICED else v) for k, v in batch.items()}
    out["num_tokens"] = batch["loss_mask"].sum().float()
    return out


def sequence_kwargs(batch: Optional[Batch]) -> Dict[str, torch.Tensor]:
    """The model's per-token inputs a micro-batch carries (position_ids, segment_ids), for any stage."""
    if batch is None:
        return {}
    return {k: batch[k] for k in ("position_ids", "segment_ids") if k in batch}
