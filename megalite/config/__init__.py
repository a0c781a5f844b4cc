"""Configuration: the typed sections, their flags, parsing and validation.

``sections.py`` holds the frozen dataclass sections (each field declares its Megatron flag next to
its default; ``moe.py`` the mixture-of-experts fields, ``flags.py`` the vocabulary for declaring
them); ``arguments.py`` builds the parser from those declarations and reads it back;
``validate.py`` (and ``validate_moe.py``) the rules between flags, before any process group
exists; ``settings.py`` RunSettings (what the sections imply for one run); ``preflight.py`` the
output paths probed before training; ``cli.py`` the command-line pieces the tools share.
Every bad-flag error is a :class:`ConfigError` raised from this package.
"""

from megalite.config.sections import (
    HELP_GROUPS,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)

__all__ = [
    "Config",
    "ConfigError",
    "ModelConfig",
    "ParallelConfig",
    "OptimConfig",
    "DataConfig",
    "TrainConfig",
    "CheckpointConfig",
    "LoggingConfig",
    "HELP_GROUPS",
]
