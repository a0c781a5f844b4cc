"""DualPipeV's paired forwards on CUDA (--overlap-moe-expert-parallel-comm): which side stream each takes.

Autograd runs a backward op on the stream its forward ran on, so the forward paired with a backward must
not take the side stream that backward's forward ran on (both would queue on one stream: no overlap).
The bookkeeping is plain Python and is checked here with stand-in streams (no GPU on CI); the CUDA run
itself is unmeasured until a multi-GPU machine runs it.
"""

from megalite.pipeline.actions import Compute
from megalite.pipeline.pairing import PairStreams


def _streams() -> PairStreams:
    s = PairStreams.__new__(PairStreams)  # the stream choice without torch.cuda.Stream (CPU build)
    s.device, s.side, s.forward_on = None, ["side 0", "side 1"], {}
    return s


def test_a_paired_forward_never_takes_its_partners_backward_stream():
    s = _streams()
    f, b = (lambda mb, ch: Compute("F", mb, ch)), (lambda mb, ch: Compute("B", mb, ch))
    assert s.for_pair(f(1, 1), b(0, 0)) == "side 0"  # b's forward ran on the main stream
    assert s.for_pair(f(2, 1), b(1, 1)) == "side 1"  # b's forward ran on side 0
    assert s.for_pair(f(3, 0), b(2, 1)) == "side 0"  # ... on side 1
    assert s.for_pair(f(4, 0), b(3, 1)) == "side 0"  # (3, 1) never ran paired: main
    assert s.forward_on == {(3, 0): 0, (4, 0): 0}  # a backward's entry goes once it has run
