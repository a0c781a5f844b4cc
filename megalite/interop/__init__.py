"""Other projects' files: Hugging Face and Megatron-LM checkpoints, read and written.

``interchange.py`` (a model as named layer streams: ModelSource, Layout), ``hf.py`` +
``hf_moe.py`` (Hugging Face GPT-2/Llama/Mixtral/Qwen2-MoE), ``megatron.py`` (Megatron-LM's legacy
torch format; ``megatron_buckets.py`` its distributed-optimizer buckets), ``torch_dist.py`` /
``torch_dist_save.py`` / ``torch_dist_optim.py`` (Megatron-Core's torch_dist: read, write, optimizer
state), ``torch_dist_load.py`` (torch_dist as a run's load source), ``native_io.py`` (megalite's
own files as layer streams, for conversion and inference), ``tokenizer_vocab.py`` (a Megatron
run's vocabulary per tokenizer type). The runtime never imports this package: the composition root
(training/, tools/) does, and hands :func:`checkpoint_formats` to the Checkpointer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megalite.checkpointing.formats import FormatRegistry

__all__ = ["checkpoint_formats"]


def checkpoint_formats() -> "FormatRegistry":
    """The run's own checkpoint formats plus the load sources of other projects (Megatron-Core's torch_dist)."""
    from megalite.checkpointing.run_formats import RUN_FORMATS  # imported here: `import megalite.interop.x`
    from megalite.interop.torch_dist_load import TorchDistLoadSource  # stays light for the tools

    return RUN_FORMATS.with_sources(TorchDistLoadSource())
