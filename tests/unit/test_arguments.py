"""The CLI: Megatron flag names map onto config sections; bad input fails with one line."""

import subprocess
import sys

import pytest

from megalite.config import ConfigError
from megalite.config.arguments import parse_args
from tests.helpers import REPO


def test_megatron_flags_map_to_config():
    cfg = parse_args(
        [
            "--num-layers",
            "8",
            "--hidden-size",
            "64",
            "--num-attention-heads",
            "8",
            "--group-query-attention",
            "--num-query-groups",
            "2",
            "--seq-length",
            "32",
            "--max-position-embeddings",
            "64",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "16",
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "2",
            "--normalization",
            "RMSNorm",
            "--swiglu",
            "--position-embedding-type",
            "rope",
            "--untie-embeddings-and-output-weights",
            "--disable-bias-linear",
            "--lr",
            "3e-4",
            "--lr-decay-style",
            "linear",
            "--mock-data",
            "--vocab-size",
            "1000",
        ],
        world_size=8,
    )
    m, p = cfg.model, cfg.parallel
    assert (m.num_layers, m.hidden_size, m.num_query_groups, m.max_positions) == (8, 64, 2, 64)
    assert m.normalization == "RMSNorm" and m.swiglu and m.position_embedding_type == "rope"
    assert not m.tied_embeddings and not m.add_bias_linear and m.vocab_size == 1000
    assert (p.tp, p.pp, p.vp) == (2, 2, 2)
    assert cfg.optim.lr == 3e-4 and cfg.optim.lr_decay_style == "linear"
    assert cfg.train.global_batch_size == 16 and cfg.data.mock_data


def test_precision_memory_and_optimizer_flags_map_to_config():
    cfg = parse_args(
        [
            "--bf16",
            "--recompute-activations",
            "--use-distributed-optimizer",
            "--overlap-grad-reduce",
            "--overlap-param-gather",
            "--ddp-bucket-size",
            "1000",
            "--sequence-parallel",
            "--tensor-model-parallel-size",
            "2",
            "--attention-backend",
            "unfused",
        ],
        world_size=4,
    )
    m, o = cfg.model, cfg.optim
    assert m.params_dtype == "bfloat16" and m.recompute_granularity == "selective"
    assert o.accumulate_allreduce_grads_in_fp32  # always with bf16, as Megatron
    assert o.use_distributed_optimizer and o.overlap_grad_reduce and o.overlap_param_gather
    assert o.ddp_bucket_size == 1000 and cfg.parallel.sequence_parallel and m.attention_backend == "unfused"
    cfg = parse_args(
        [
            "--fp16",
            "--initial-loss-scale",
            "1024",
            "--hysteresis",
            "3",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "block",
            "--recompute-num-layers",
            "2",
        ],
        world_size=1,
    )
    assert cfg.model.params_dtype == "float16" and not cfg.optim.accumulate_allreduce_grads_in_fp32
    assert (cfg.optim.initial_loss_scale, cfg.optim.hysteresis, cfg.optim.min_loss_scale) == (1024, 3, 1.0)
    assert (cfg.model.recompute_method, cfg.model.recompute_num_layers) == ("block", 2)
    # as Megatron: sequence parallelism is switched off when there is no tensor parallelism
    assert not parse_args(["--sequence-parallel"], world_size=1).parallel.sequence_parallel


def test_cli_defaults_are_the_config_defaults():
    cfg = parse_args([], world_size=1)
    from dataclasses import replace

    from megalite.config import DataConfig, ModelConfig, OptimConfig, TrainConfig

    assert replace(cfg.model, vocab_size=0) == ModelConfig()
    assert cfg.optim == OptimConfig() and cfg.train == TrainConfig() and cfg.data == DataConfig()


def test_help_shows_every_new_flag_with_its_default():
    from megalite.config.arguments import build_parser

    text = " ".join(build_parser().format_help().split())
    for flag in (
        "--bf16",
        "--fp16",
        "--loss-scale",
        "--initial-loss-scale",
        "--min-loss-scale",
        "--loss-scale-window",
        "--hysteresis",
        "--accumulate-allreduce-grads-in-fp32",
        "--recompute-granularity",
        "--recompute-method",
        "--recompute-num-layers",
        "--recompute-activations",
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
        "--ddp-bucket-size",
        "--sequence-parallel",
        "--compile",
        "--torch-compile",
        "--attention-backend",
    ):
        assert flag in text, flag
    assert "(default: 4294967296.0)" in text and "(default: 1000)" in text


def test_every_flag_has_help_in_megatrons_groups_and_unimplemented_ones_are_listed():
    import argparse

    from megalite.config.arguments import NOT_IMPLEMENTED, build_parser

    p = build_parser()
    for action in p._actions:
        if action.option_strings and action.help is not argparse.SUPPRESS and "-h" not in action.option_strings:
            # a sentence of its own, not only the default
            assert action.help and not action.help.startswith("(default"), action.option_strings
    titles = [g.title for g in p._action_groups]
    for megatron_group in (
        "network size",
        "regularization",
        "training",
        "initialization",
        "learning rate",
        "checkpointing",
        "mixed precision",
        "distributed",
        "validation",
        "data and dataloader",
        "logging",
    ):
        assert megatron_group in titles
    text = " ".join(p.format_help().split())
    assert "(default: 10.0)" in text  # --distributed-timeout-minutes shows its default
    for flag in NOT_IMPLEMENTED:
        assert flag in text.split("not implemented yet")[-1]


def test_query_groups_need_the_gqa_flag():
    with pytest.raises(ConfigError, match="--num-query-groups needs --group-query-attention"):
        parse_args(["--num-query-groups", "2", "--mock-data"], world_size=1)
    assert (
        parse_args(
            ["--num-query-groups", "2", "--group-query-attention", "--mock-data"], world_size=1
        ).model.num_query_groups
        == 2
    )


@pytest.mark.parametrize(
    "argv,world,message",
    [
        (["--tensor-model-parallel-size", "3"], 4, r"world size 4 is not divisible"),
        (
            ["--tensor-model-parallel-size", "8", "--num-attention-heads", "4", "--hidden-size", "64"],
            8,
            r"--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 8",
        ),
        (
            ["--group-query-attention", "--num-query-groups", "1", "--tensor-model-parallel-size", "2"],
            2,
            r"--num-query-groups 1 is not divisible by --tensor-model-parallel-size 2",
        ),
        (["--pipeline-model-parallel-size", "3", "--num-layers", "4"], 3, r"(?i)layers"),
        (["--global-batch-size", "12", "--micro-batch-size", "4"], 2, r"--global-batch-size 12 is not divisible"),
        (["--hidden-size", "100", "--num-attention-heads", "3"], 1, r"--hidden-size 100 is not divisible"),
        (["--no-such-flag", "1"], 1, r"unrecognized arguments: --no-such-flag 1"),
        (["--bf16", "--fp16"], 1, r"--bf16 and --fp16 are exclusive"),
        (["--recompute-granularity", "full"], 1, r"--recompute-granularity full needs --recompute-method"),
        (["--recompute-method", "block"], 1, r"--recompute-method applies to --recompute-granularity full"),
        (
            ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "0"],
            1,
            r"--recompute-num-layers must be >= 1",
        ),
        (
            [
                "--sequence-parallel",
                "--tensor-model-parallel-size",
                "4",
                "--seq-length",
                "130",
                "--max-position-embeddings",
                "130",
            ],
            4,
            r"--sequence-parallel needs --seq-length 130 divisible",
        ),
        (["--overlap-param-gather"], 1, r"--overlap-param-gather needs --use-distributed-optimizer"),
        (["--fp16", "--hysteresis", "0"], 1, r"--hysteresis must be > 0"),
        (["--ddp-bucket-size", "0"], 1, r"--ddp-bucket-size must be > 0"),
        (["--num-workers", "-1"], 1, r"--num-workers must be >= 0"),
        (["--attention-backend", "magic"], 1, r"invalid choice: 'magic'"),
        # single-flag ranges: the flag and its legal range; negative numbers are values, not flags
        (["--lr", "-1e-3"], 1, r"--lr must be > 0, got -0.001"),
        (["--lr", "-1"], 1, r"--lr must be > 0, got -1"),
        (["--log-interval", "0"], 1, r"--log-interval must be > 0"),
        (["--make-vocab-size-divisible-by", "0"], 1, r"--make-vocab-size-divisible-by must be > 0"),
        (["--hidden-dropout", "1.0"], 1, r"--hidden-dropout must be in \[0, 1\), got 1"),
        (["--attention-dropout", "-0.1"], 1, r"--attention-dropout must be in \[0, 1\)"),
        (["--adam-beta1", "1.2"], 1, r"--adam-beta1 must be in \[0, 1\)"),
        (["--adam-beta2", "-0.5"], 1, r"--adam-beta2 must be in \[0, 1\)"),
        (["--num-threads", "-1"], 1, r"--num-threads must be > 0, got -1"),
        (["--rotary-base", "0"], 1, r"--rotary-base must be > 0"),
        (["--ffn-hidden-size", "0"], 1, r"--ffn-hidden-size must be > 0"),
        (["--min-lr", "0.01", "--lr", "0.001"], 1, r"--min-lr 0.01 is above --lr 0.001"),
        (["--lr-warmup-iters", "-5"], 1, r"--lr-warmup-iters must be >= 0, got -5"),
        (["--clip-grad", "-1"], 1, r"--clip-grad must be >= 0, got -1"),
        (["--eval-interval", "-10"], 1, r"--eval-interval must be >= 0"),
        (["--exit-interval", "0"], 1, r"--exit-interval must be > 0"),
        (["--train-iters", "-1"], 1, r"--train-iters must be >= 0"),
        (["--skip-train", "--eval-iters", "0"], 1, r"--skip-train only evaluates, but --eval-iters or --eval-interval"),
        (["--skip-train"], 1, r"--skip-train evaluates a trained model: give its checkpoint with --load DIR"),
        (["--train-iter", "5"], 1, r"unrecognized argument --train-iter; did you mean --train-iters\?"),
        (["--tensor-parallel-size", "2"], 1, r"did you mean --tensor-model-parallel-size\?"),
        (["--num-experts", "6", "--expert-model-parallel-size", "4"], 4, r"--num-experts 6 is not divisible"),
        (["--save-interval", "10"], 1, r"--save-interval needs --save DIR"),
        (["--save", "/tmp/x", "--save-interval", "0"], 1, r"--save-interval must be > 0"),
        (["--ckpt-format", "torch_dist"], 1, r"invalid choice: 'torch_dist'"),
        (["--lr-decay-style", "exp"], 1, r"invalid choice: 'exp'"),
        (["--num-layers", "two"], 1, r"invalid int value: 'two'"),
        (["--seq-length", "256", "--max-position-embeddings", "128"], 1, r"exceeds --max-position-embeddings"),
        # pipeline layouts
        (
            [
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers",
                "8",
                "--num-layers-per-virtual-pipeline-stage",
                "2",
                "--global-batch-size",
                "24",
                "--micro-batch-size",
                "8",
            ],
            2,
            r"interleaved.*multiple of|m % pp|divisible",
        ),
        (["--virtual-pipeline-model-parallel-size", "2"], 1, r"needs --pipeline-model-parallel-size > 1"),
        (
            ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "no_pipelining"],
            2,
            r"no_pipelining needs pp=1",
        ),
        (
            ["--pipeline-model-parallel-size", "4", "--num-layers", "8", "--decoder-first-pipeline-num-layers", "8"],
            4,
            r"decoder-first-pipeline-num-layers",
        ),
        (
            [
                "--num-layers-per-virtual-pipeline-stage",
                "2",
                "--virtual-pipeline-model-parallel-size",
                "2",
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers",
                "8",
            ],
            2,
            r"not both",
        ),
        (
            [
                "--num-layers-per-virtual-pipeline-stage",
                "3",
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers",
                "8",
            ],
            2,
            r"--num-layers-per-virtual-pipeline-stage 3 must divide",
        ),
    ],
)
def test_bad_input_is_one_line_error(argv, world, message):
    with pytest.raises(ConfigError, match=message) as e:
        parse_args(argv, world_size=world)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("rank,lines", [("0", 1), ("1", 0)])
def test_flag_errors_are_printed_once_per_job(rank, lines):
    proc = subprocess.run(
        [sys.executable, "pretrain_gpt.py", "--lr", "-1e-3"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"WORLD_SIZE": "2", "RANK": rank, "PATH": ""},
        cwd=REPO,
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == lines, proc.stderr


def test_pretrain_cli_reports_error_before_any_process_group(tmp_path):
    proc = subprocess.run(
        [sys.executable, "pretrain_gpt.py", "--tensor-model-parallel-size", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"WORLD_SIZE": "3", "PATH": ""},
        cwd=REPO,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: world size 3")


# -- the parser is built from the flag declarations next to the config fields ------------------------------------


def _declared():
    from megalite.config.arguments import declared_fields

    return list(declared_fields())


def test_every_declared_field_is_an_option_with_the_fields_default():
    import argparse

    from megalite.config.arguments import build_parser

    parser = build_parser()
    actions = {o: a for a in parser._actions for o in a.option_strings}
    for _cls, f, _tp, cli in _declared():
        for flag in cli.flags:
            assert flag.name in actions, flag.name
            assert [g.title for g in parser._action_groups if actions[flag.name] in g._group_actions] == [flag.group], (
                flag.name
            )
        if cli.own is None:
            continue
        action = actions[cli.own.name]
        assert action.dest == f.name and action.help == cli.own.help
        if "parser_default" in cli.own.options:  # e.g. --vocab-size: None, worked out by the field's value
            assert action.default == cli.own.options["parser_default"] and cli.value is not None
        elif f.default == ():  # list flags: absent is None, read back as ()
            assert action.default is None and action.nargs == "*"
        else:
            assert action.default == f.default, cli.own.name
        if isinstance(f.default, bool):
            assert isinstance(action, argparse._StoreTrueAction if not f.default else argparse._StoreFalseAction)


def test_every_option_is_declared_once_by_a_field():
    from megalite.config.arguments import NOT_IMPLEMENTED, build_parser

    declared = [flag.name for *_, cli in _declared() for flag in cli.flags]
    assert len(declared) == len(set(declared))  # each flag declared in exactly one place
    options = [o for a in build_parser()._actions for o in a.option_strings if o not in ("-h", "--help")]
    assert sorted(options) == sorted(declared + list(NOT_IMPLEMENTED))


def test_only_log_timers_has_no_flag():
    from dataclasses import fields

    from megalite.config import Config

    with_flags = {f.name for _c, f, _t, _cli in _declared()}
    every = {f.name for s in fields(Config) for f in fields(s.default_factory)}
    assert every - with_flags == {"log_timers"}


def test_schedule_choices_come_from_the_registry():
    from megalite.config.arguments import build_parser
    from megalite.pipeline.registry import SCHEDULES

    action = next(a for a in build_parser()._actions if "--pipeline-schedule" in a.option_strings)
    assert tuple(action.choices) == tuple(SCHEDULES)


def test_declared_ranges_give_one_line_with_the_flag():
    from dataclasses import replace

    from megalite.config import Config, ModelConfig
    from megalite.config.validate import check_ranges

    with pytest.raises(ConfigError, match=r"^--norm-epsilon must be > 0, got -1$"):
        check_ranges(Config(model=ModelConfig(layernorm_epsilon=-1.0)))
    with pytest.raises(ConfigError, match=r"^--recompute-num-layers must be >= 1, got 0$"):
        check_ranges(Config(model=replace(ModelConfig(), recompute_num_layers=0)))
    check_ranges(Config())  # the defaults are in range


@pytest.mark.parametrize(
    "argv,world,expected",
    [
        ([], 1, (1, 2, "no_pipelining", False, (4,))),
        (["--global-batch-size", "32", "--micro-batch-size", "2"], 4, (4, 4, "no_pipelining", False, (4,))),
        (
            [
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers",
                "8",
                "--virtual-pipeline-model-parallel-size",
                "2",
                "--global-batch-size",
                "32",
                "--micro-batch-size",
                "2",
            ],
            4,
            (2, 8, "interleaved_1f1b", False, (2, 2, 2, 2)),
        ),
        (
            [
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers",
                "6",
                "--pipeline-stage-layers",
                "1,2,2,1",
                "--virtual-pipeline-model-parallel-size",
                "2",
                "--pipeline-schedule",
                "zbv",
            ],
            2,
            (1, 2, "zbv", True, (1, 2, 2, 1)),
        ),
        (
            ["--pipeline-model-parallel-size", "2", "--num-layers", "6", "--decoder-first-pipeline-num-layers", "2"],
            2,
            (1, 2, "1f1b", False, (2, 4)),
        ),
        (["--pipeline-model-parallel-size", "2", "--pipeline-balance", "measured"], 2, (1, 2, "1f1b", False, None)),
    ],
)
def test_resolve_settings(argv, world, expected):
    from megalite.config.settings import resolve_settings

    cfg = parse_args(argv, world_size=world)
    s = resolve_settings(cfg, world)
    assert (s.dp, s.num_microbatches, s.schedule, s.layout.v_shape, s.stage_layers) == expected
    assert s.spec.name == s.schedule and s.layout.pp == cfg.parallel.pp and s.layout.vp == cfg.parallel.vp


def test_resolve_settings_refuses_what_it_cannot_derive():
    from megalite.config import Config, ParallelConfig, TrainConfig
    from megalite.config.settings import resolve_settings

    with pytest.raises(ConfigError, match="world size 3 is not divisible"):
        resolve_settings(Config(parallel=ParallelConfig(tp=2)), 3)
    with pytest.raises(
        ConfigError, match="--global-batch-size 16 is not divisible by --micro-batch-size 8 x data-parallel size 4"
    ):
        resolve_settings(Config(train=TrainConfig(micro_batch_size=8, global_batch_size=16)), 4)
    with pytest.raises(ConfigError, match="interleaved_1f1b needs vp > 1"):
        resolve_settings(Config(parallel=ParallelConfig(pipeline_schedule="interleaved_1f1b")), 1)
