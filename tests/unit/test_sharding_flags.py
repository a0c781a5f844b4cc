"""--data-parallel-sharding-strategy and its companions: Megatron's names map onto the config, bad
combinations are one line naming the flags."""

import re

import pytest

from megalite.config import ConfigError
from megalite.config.arguments import parse_args

SMALL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]
SMALL += ["--micro-batch-size", "1", "--global-batch-size", "8"]


@pytest.mark.parametrize(
    "argv,sharding,distributed_optimizer",
    [
        ([], "no_shard", False),
        (["--use-distributed-optimizer"], "optim", True),
        (["--data-parallel-sharding-strategy", "optim"], "optim", True),
        (["--data-parallel-sharding-strategy", "optim_grads"], "optim_grads", False),
        (["--use-torch-fsdp2"], "optim_grads_params", False),
        (["--use-torch-fsdp2", "--data-parallel-sharding-strategy", "optim_grads_params"], "optim_grads_params", False),
    ],
)
def test_strategy_flags_map_to_config(argv, sharding, distributed_optimizer):
    cfg = parse_args(SMALL + argv, world_size=4)
    assert cfg.optim.sharding == sharding
    assert cfg.optim.fsdp == (sharding in ("optim_grads", "optim_grads_params"))
    assert cfg.optim.use_distributed_optimizer == distributed_optimizer


def test_hybrid_sharding_and_reshard_flags():
    cfg = parse_args(
        SMALL + ["--use-torch-fsdp2", "--no-reshard-after-forward", "--num-distributed-optimizer-instances", "2"],
        world_size=8,
    )
    assert (cfg.optim.reshard_after_forward, cfg.optim.num_distributed_optimizer_instances) == (False, 2)


@pytest.mark.parametrize(
    "argv,world,message",
    [
        (["--data-parallel-sharding-strategy", "zero3"], 2, "invalid choice: 'zero3'"),
        (
            ["--use-torch-fsdp2", "--data-parallel-sharding-strategy", "optim"],
            2,
            r"^--use-torch-fsdp2 means --data-parallel-sharding-strategy optim_grads_params, but "
            r"--data-parallel-sharding-strategy optim was given; drop one$",
        ),
        (
            ["--data-parallel-sharding-strategy", "no_shard", "--use-distributed-optimizer"],
            2,
            r"^--data-parallel-sharding-strategy no_shard contradicts --use-distributed-optimizer",
        ),
        (
            ["--data-parallel-sharding-strategy", "optim_grads", "--no-reshard-after-forward"],
            2,
            r"^--no-reshard-after-forward applies to --data-parallel-sharding-strategy optim_grads_params "
            r"\(this run: optim_grads\); drop it$",
        ),
        (
            ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"],
            4,
            r"^--num-distributed-optimizer-instances 2 \(hybrid sharding\) needs --data-parallel-sharding-strategy",
        ),
        (
            ["--use-torch-fsdp2", "--num-distributed-optimizer-instances", "3"],
            4,
            r"^--num-distributed-optimizer-instances 3 must divide the data-parallel x context-parallel size 4",
        ),
        (
            ["--use-torch-fsdp2", "--num-distributed-optimizer-instances", "4"],
            4,
            r"leave at least 2 ranks per instance",
        ),
        (["--use-torch-fsdp2", "--num-distributed-optimizer-instances", "0"], 4, r"must be > 0, got 0$"),
        (
            [
                "--use-torch-fsdp2",
                "--pipeline-model-parallel-size",
                "2",
                "--pipeline-schedule",
                "zb_h1",
                "--num-layers",
                "4",
            ],
            4,
            r"^--data-parallel-sharding-strategy optim_grads_params cannot run --pipeline-schedule zb_h1: its split",
        ),
    ],
)
def test_bad_combinations_are_one_line(argv, world, message, capsys):
    with pytest.raises((ConfigError, SystemExit)) as e:
        parse_args(SMALL + argv, world_size=world)
    text = str(e.value) if isinstance(e.value, ConfigError) else capsys.readouterr().err.strip().splitlines()[-1]
    assert "\n" not in str(e.value)
    assert re.search(message, text), text
