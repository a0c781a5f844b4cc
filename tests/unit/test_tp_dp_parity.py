"""The one-process run the TP x DP layouts reproduce (the gpt2_reference fixture, tests/conftest.py) trains:
its loss falls. (The layouts: tests/distributed/test_tp_dp_parity.py.)"""


def test_loss_falls_in_reference_run(gpt2_reference):
    losses = gpt2_reference["losses"]
    assert losses[-1] < losses[0] - 0.05, losses
