"""The FP8 flags' rules (``--fp8-format`` and its companions; README, FP8 training).

``check_fp8`` runs inside ``validate`` (no device yet); ``check_fp8_device`` runs at start once the
rank's device is known. Each failure is one ConfigError line naming the flag and what to do.
"""

from __future__ import annotations

from megalite.config import Config, ConfigError, ModelConfig
from megalite.config.settings import RunSettings

RUNNABLE_RECIPES = ("tensorwise", "delayed", "rowwise")


def check_fp8(cfg: Config, settings: RunSettings) -> None:
    """Flag combinations FP8 cannot run (nothing to check without --fp8-format)."""
    m = cfg.model
    if m.fp8_format is None:
        return
    if m.fp8_recipe not in RUNNABLE_RECIPES:
        raise ConfigError(
            f"--fp8-recipe {m.fp8_recipe} is not implemented in megalite; use one of {', '.join(RUNNABLE_RECIPES)}"
        )
    if m.params_dtype != "bfloat16":
        raise ConfigError("--fp8-format needs --bf16 (bf16 weights and activations around the FP8 GEMMs); add --bf16")
    import torch

    if not hasattr(torch, "float8_e4m3fn"):
        raise ConfigError(f"--fp8-format needs torch >= 2.1 (float8 dtypes); this is torch {torch.__version__}")
    if m.fp8_recipe == "delayed" and m.recompute_granularity == "full":
        raise ConfigError(
            "--fp8-recipe delayed with --recompute-granularity full would record amaxes out of order; "
            "use --fp8-recipe tensorwise or drop the full recomputation"
        )
    if settings.spec.split_backward:
        raise ConfigError(
            f"--pipeline-schedule {settings.schedule} splits weight gradients from input gradients, which the "
            "FP8 linears do not; use 1f1b (or interleaved_1f1b) or drop --fp8-format"
        )
    if m.first_last_layers_bf16 and not any(m.fp8_layer(i) for i in range(m.num_layers)):
        raise ConfigError(
            f"--num-layers-at-start-in-bf16 {m.num_layers_at_start_in_bf16} + --num-layers-at-end-in-bf16 "
            f"{m.num_layers_at_end_in_bf16} cover all {m.num_layers} layers: no layer is left in FP8; lower them"
        )


def check_fp8_device(m: ModelConfig, device) -> None:
    """FP8 GEMMs need compute capability 8.9 (Ada, Hopper and newer) on CUDA; on CPU they are emulated
    (float8 values multiplied in fp32: for tests and debugging, slower than bf16)."""
    if m.fp8_format is None or getattr(device, "type", str(device)) != "cuda":
        return
    import torch

    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ConfigError(
            f"--fp8-format needs a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
            f"{name} has {cap[0]}.{cap[1]}: drop --fp8-format"
        )
