"""A rank stuck inside a layer is named with the collective its peers wait in (issue 33): the model's own
collectives (tensor parallel, the CP ring and all-to-all, the MoE dispatch) are in the flight recorder.

Two gloo ranks run a tiny GPT forward; rank 1 stalls at the start of its first layer (after the embedding's
collectives, before the layer's) until rank 0 has been caught blocked in a recorded collective and has
taken its snapshot. The hang diagnosis of the two snapshots, with the hang watch's metadata, must name rank
1 and the collective rank 0 waits in. A full forward and backward afterwards leave every member of a group
with the same per-group count (the sequence numbers the diagnosis compares).
"""

import os
import re
import threading
import time

import pytest
import torch

from megalite.config import ModelConfig
from megalite.model.gpt import GPTModel
from megalite.observability.diagnosis import diagnose
from megalite.observability.hang_watch import HangWatch
from megalite.tensor_parallel import RNGTracker

CATCH_S = 20.0  # how long rank 0 may take to reach its blocking collective (loaded CI cores)


def _snap(ps, tmp):
    return {**HangWatch(ps, ps.recorder, tmp, 60.0).meta(), **ps.recorder.snapshot()}


def _catch_blocked(ps, tmp, out):
    """Rank 0's second thread: a snapshot once the main thread blocks in a recorded collective."""
    deadline = time.time() + CATCH_S
    while time.time() < deadline:
        e = ps.recorder.current_wait()
        if e is not None and e.get("on") == "coll" and time.time() - e["start"] > 0.2:
            break
        time.sleep(0.02)
    out.append(_snap(ps, tmp))
    open(os.path.join(tmp, "caught"), "w").close()


def _stall_then_run(ps, tmp, model_kw, dispatcher):
    ps.recorder.resize(512)
    cfg = ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=16,
        vocab_size=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **model_kw,
    )
    model = GPTModel(cfg, ps, RNGTracker(1, 0, 0, ps.device), seed=1, moe_dispatcher=dispatcher).train()
    snaps = []
    if ps.rank == 0:
        watcher = threading.Thread(target=_catch_blocked, args=(ps, tmp, snaps), daemon=True)
        watcher.start()
    else:

        def stall(module, args):  # the injected hang, finite: until rank 0 has been caught waiting
            snaps.append(_snap(ps, tmp))
            deadline = time.time() + CATCH_S + 5
            while not os.path.exists(os.path.join(tmp, "caught")) and time.time() < deadline:
                time.sleep(0.02)

        handle = next(iter(model.decoder.layers.values())).register_forward_pre_hook(stall)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (2, 16 // ps.cp.size), generator=g)
    event = ps.recorder.record("F", mb=0, chunk=0, run=1)
    logits = model(tokens)
    ps.recorder.done(event)
    if ps.rank == 0:
        watcher.join()
    else:
        handle.remove()
    model.loss(logits, tokens, torch.ones_like(tokens)).backward()
    return snaps[0], ps.recorder.snapshot()["seq"]


CASES = {  # name: (run_distributed sizes, model flags, dispatcher, rank 1 named, the collective rank 0 waits in)
    "tp2": (dict(tp=2), {}, "allgather", "rank 1 (stage 0, dp 0, tp 1)", r"all_reduce #\d+ \(tp group\)"),
    "cp2": (dict(cp=2), {}, "allgather", "rank 1 (stage 0, dp 0, cp 1)", r"ring_exchange #1 \(cp group\)"),
    "ep2": (
        dict(ep=2),
        dict(num_experts=4),
        "alltoall",
        "rank 1 (stage 0, dp 1)",
        r"all_to_all_single #1 \(expert_mp group\)",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_rank_stuck_inside_a_layer_is_named_with_the_collective_its_peers_wait_in(case, tmp_path, run_distributed):
    sizes, model_kw, dispatcher, who, collective = CASES[case]
    results = run_distributed(_stall_then_run, 2, str(tmp_path), model_kw, dispatcher, **sizes)
    (snap0, seq0), (snap1, seq1) = results
    sentence = diagnose({0: snap0, 1: snap1}, 2)
    assert re.fullmatch(
        rf"{re.escape(who)} stopped progressing in F micro-batch 0 chunk 0 \(busy in it for \d+ s and still answering: "
        rf"a long or endless computation or loop\); rank 0 waits for it in {collective}",
        sentence,
    ), sentence
    assert seq0 == seq1 and seq0, (seq0, seq1)  # every member counted the same collectives per group


def _reporting_collectives(ps):
    """The grad norm over the model-parallel group (clip_grads), the MoE statistics' all-reduce and the
    straggler check's gathers (the log line's collectives): what each rank's recorder saw of them."""
    from megalite.moe.metrics import reduce_moe_stats
    from megalite.observability.stragglers import StragglerMonitor
    from megalite.optim.clip_grads import global_grad_norm

    ps.recorder.resize(256)
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), float(ps.rank + 1))
    norm = global_grad_norm([p], ps)
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64, num_experts=4)
    reduce_moe_stats([], ps, 1, cfg)  # a rank may hold no MoE layer: it joins the reduction all the same
    monitor = StragglerMonitor(1.5, ps, 1.0, 1, 10)
    monitor.check()
    events = ps.recorder.events()
    colls = [(e["op"], e["group"], e["seq"]) for e in events if e["kind"] == "coll"]
    waits = [(e["op"], e["group"]) for e in events if e["kind"] == "wait" and e["end"] is not None]
    return norm, colls, waits


def test_the_grad_norm_and_the_log_lines_collectives_are_recorded(run_distributed):
    (norm0, colls0, waits0), (norm1, colls1, waits1) = run_distributed(_reporting_collectives, 2, tp=2)
    # a parameter without a tp split is replicated: counted once, on tp rank 0 (rank 1 learns it in the reduce)
    assert norm0 == norm1 == pytest.approx(3**0.5)
    assert (
        colls0
        == colls1
        == [
            ("all_reduce", "mp", 1),
            ("all_reduce", "world", 1),
            ("all_gather_object", "world", 2),
            ("all_gather", "world", 3),
        ]
    )
    assert waits0 == waits1 == [(op, group) for op, group, _ in colls0]  # each one's wait: what a hang shows
