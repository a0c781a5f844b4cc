"""Packed documents (--reset-position-ids, --reset-attention-mask, --eod-mask-loss) and the CP token layout.

The oracle for the model: a document inside a packed sequence gets the same logits as the
document run alone (positions from 0, nothing before it to attend to). The oracle for the
fields: Megatron-Core's get_ltor_masks_and_position_ids (skipped when megatron-core is absent).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from megalite.config import Config, DataConfig, ModelConfig
from megalite.context_parallel.sequence import SequenceOptions, add_document_fields, cp_token_index, slice_for_cp
from megalite.data.batches import MicroBatches, eod_token, sequence_options
from megalite.model.gpt import GPTModel
from megalite.parallel.state import ParallelState
from megalite.tensor_parallel.random import RNGTracker

EOD = 96
LEARNED = dict()
ROPE = dict(
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    add_bias_linear=False,
    num_query_groups=2,
    untie_embeddings_and_output_weights=True,
)


def _tokens(seed: int, b: int, s: int, eods: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, EOD, (b, s), generator=g)
    for row in range(b):
        t[row, torch.randperm(s, generator=g)[:eods]] = EOD
    return t


def test_cp_token_index_balances_the_causal_work():
    assert cp_token_index(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_token_index(16, 2, 1).tolist() == list(range(4, 12))
    assert cp_token_index(16, 4, 1).tolist() == [2, 3, 12, 13]
    every = torch.cat([cp_token_index(32, 4, r) for r in range(4)])
    assert sorted(every.tolist()) == list(range(32))
    work = [int((cp_token_index(32, 4, r) + 1).sum()) for r in range(4)]  # keys each rank's queries see
    assert len(set(work)) == 1, work
    assert cp_token_index(8, 1, 0).tolist() == list(range(8))
    with pytest.raises(ValueError, match="divisible by 2 x context-parallel-size"):
        cp_token_index(12, 4, 0)


def test_document_fields_follow_the_flags():
    tokens = torch.tensor([[5, 7, EOD, 3, 4, EOD, 9], [EOD, 1, 2, 3, EOD, EOD, 4]])
    batch = {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(2, 7)}
    out = add_document_fields(batch, EOD, True, True, True)
    assert out["segment_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 2, 3]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 0], [0, 0, 1, 2, 3, 0, 0]]
    assert out["loss_mask"].tolist() == (tokens != EOD).float().tolist()  # exactly the eod inputs
    only_loss = add_document_fields(batch, EOD, False, False, True)
    assert set(only_loss) == {"tokens", "labels", "loss_mask"}
    assert "segment_ids" not in add_document_fields(batch, EOD, True, False, False)
    assert add_document_fields(batch, EOD, False, True, False)["loss_mask"].sum() == 14  # untouched


@pytest.mark.slow  # importing megatron-core takes seconds
def test_document_fields_match_megatron_core():
    gpt_dataset = pytest.importorskip("megatron.core.datasets.gpt_dataset")
    for seed in range(4):
        tokens = _tokens(seed, 1, 40, eods=seed * 2 + 1)[0]
        tokens[-1] = EOD if seed == 3 else tokens[-1]
        mask, loss_mask, positions = gpt_dataset._get_ltor_masks_and_position_ids(tokens, EOD, True, True, True, True)
        ours = add_document_fields(
            {"tokens": tokens[None], "labels": tokens[None], "loss_mask": torch.ones(1, 40)}, EOD, True, True, True
        )
        assert ours["position_ids"][0].tolist() == positions.tolist()
        assert ours["loss_mask"][0].tolist() == loss_mask.tolist()
        seg = ours["segment_ids"][0]
        allowed = (seg[None, :] == seg[:, None]) & torch.ones(40, 40, dtype=torch.bool).tril()
        assert torch.equal(allowed, ~mask[0])  # Megatron's mask is True where attention is blocked


def test_cp_slice_keeps_chunks_and_the_full_documents():
    tokens = _tokens(1, 2, 16, eods=3)
    full = add_document_fields(
        {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(2, 16)}, EOD, True, True, True
    )
    parts = [slice_for_cp(full, 2, r) for r in range(2)]
    for r, part in enumerate(parts):
        index = cp_token_index(16, 2, r)
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(part[key], full[key][:, index]), key
        assert torch.equal(part["segment_ids"], full["segment_ids"])
        assert float(part["num_tokens"]) == float(full["loss_mask"].sum())
    opts = SequenceOptions(
        eod=EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True, cp_size=2, cp_rank=1
    )
    built = opts.build(tokens, tokens + 1, torch.ones(2, 16))
    assert all(torch.equal(built[k], parts[1][k]) for k in parts[1])


def _cfg(style: dict, **data) -> Config:
    m = ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=24,
        vocab_size=EOD + 1,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.2,
        **style,
    )
    return Config(model=m, data=DataConfig(mock_data=True, **data))


def _model(style: dict, **model) -> GPTModel:
    cfg = _cfg(style).model
    cfg = replace(cfg, **model)
    ps = ParallelState.single()
    return GPTModel(cfg, ps, RNGTracker(5, 0, 0, ps.device), 5)


@pytest.mark.parametrize("style", [LEARNED, ROPE], ids=["learned", "rope"])
def test_each_packed_document_gets_its_logits_alone(style):
    torch.manual_seed(0)
    model = _model(style).eval()
    tokens = torch.randint(0, EOD, (2, 24))
    tokens[0, [6, 15]] = EOD  # documents [0..6] [7..15] [16..23]
    tokens[1, [0, 10]] = EOD  # a one-token document first
    batch = add_document_fields(
        {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(2, 24)}, EOD, True, True, False
    )
    with torch.no_grad():
        packed = model(tokens, position_ids=batch["position_ids"], segment_ids=batch["segment_ids"])
        plain = model(tokens)
        for row, bounds in ((0, [(0, 7), (7, 16), (16, 24)]), (1, [(0, 1), (1, 11), (11, 24)])):
            for a, b in bounds:
                alone = model(tokens[row : row + 1, a:b])[:, 0]
                torch.testing.assert_close(packed[a:b, row], alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(packed[16:, 0], plain[16:, 0], atol=1e-3)  # the masks do change later documents


def test_packed_training_gradients_with_selective_recompute_equal_plain():
    tokens = _tokens(3, 2, 24, eods=3)
    batch = add_document_fields(
        {"tokens": tokens, "labels": tokens.roll(-1, 1), "loss_mask": torch.ones(2, 24)}, EOD, True, True, True
    )
    grads = []
    for recompute in (None, "selective"):
        model = _model(ROPE, recompute_granularity=recompute).train()
        logits = model(tokens, position_ids=batch["position_ids"], segment_ids=batch["segment_ids"])
        model.loss(logits, batch["labels"], batch["loss_mask"]).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


class _Samples:
    def __init__(self, text: np.ndarray):
        self.text = text

    def __len__(self):
        return len(self.text)

    def __getitem__(self, i):
        return {"text": self.text[i]}


def test_micro_batches_carry_the_packing_fields():
    cfg = _cfg(LEARNED, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    assert eod_token(cfg) == EOD  # mock data reads the vocabulary as NullTokenizer's: the last id is eod
    ps = ParallelState.single()
    assert sequence_options(_cfg(LEARNED), ps) is None  # nothing asked: plain batches, as before
    opts = sequence_options(cfg, ps)
    assert opts.eod == EOD and opts.cp_size == 1
    text = np.concatenate([_tokens(4, 4, 25, eods=3).numpy()])
    batches = MicroBatches(_Samples(text), 0, 2, 2, ps, sequence=opts).next()
    first = torch.from_numpy(text[:2])
    assert torch.equal(batches[0]["tokens"], first[:, :-1]) and torch.equal(batches[0]["labels"], first[:, 1:])
    expected = add_document_fields(
        {"tokens": first[:, :-1], "labels": first[:, 1:], "loss_mask": torch.ones(2, 24)}, EOD, True, True, True
    )
    for key, value in expected.items():
        assert torch.equal(batches[0][key], value), key
    assert "num_tokens" not in batches[0]  # cp 1: the local count is the count


def test_eod_is_the_tokenizers(data_bpe_files):
    vocab_file, merge_file = data_bpe_files
    cfg = _cfg(LEARNED)
    cfg = cfg.with_(
        data=replace(cfg.data, tokenizer_type="GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    )
    from megalite.data.tokenizers import build_tokenizer

    assert eod_token(cfg) == build_tokenizer(cfg.data).eod  # <|endoftext|>, as Megatron's tokenizer.eod
    null = cfg.with_(data=replace(cfg.data, tokenizer_type="NullTokenizer"))
    assert eod_token(null) == EOD  # --vocab-size 96: ids 0..95 and eod 96, the model's last id
