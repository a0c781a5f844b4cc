"""Convert GPT checkpoints between megalite, Megatron-LM (legacy torch and torch_dist formats) and Hugging Face.

Megatron-LM's interface::

    python tools/checkpoint/convert.py --model-type GPT --loader megatron --saver megalite \\
        --load-dir ckpts/megatron --save-dir ckpts/megalite \\
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2

The loader yields one layer's full tensors at a time and the saver shards them,
so memory holds about one layer plus the embedding (one pipeline rank's files
for the torch formats). Everything is checked before anything is written, and
the target is written under ``<save-dir>.tmp-convert`` and renamed when
complete: a failed conversion leaves no half-written target. Optimizer and RNG
states are not converted; load the result with ``--finetune`` (or
``--no-load-optim --no-load-rng``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from typing import Dict, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megalite.checkpointing.format_info import format_info, format_names  # noqa: E402
from megalite.checkpointing.safe_load import CheckpointError  # noqa: E402
from megalite.interop.hf import (
    TOKENIZER_FILES,
    HFSource,
    architecture_for,
    save_hf,  # noqa: E402
    tokenizer_fields,
)
from megalite.interop.interchange import Layout, ModelSource, check_fits  # noqa: E402
from megalite.interop.megatron import MegatronSource, save_megatron  # noqa: E402
from megalite.interop.native_io import MegaliteSource, megalite_writer  # noqa: E402
from megalite.interop.torch_dist import TorchDistSource, torch_dist_dir  # noqa: E402
from megalite.interop.torch_dist_save import save_torch_dist  # noqa: E402

FORMATS = ("megalite", "megatron", "hf")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Convert GPT checkpoints between megalite, Megatron-LM and Hugging Face.", allow_abbrev=False
    )
    p.add_argument("--model-type", required=True, choices=["GPT"])
    p.add_argument("--loader", required=True, choices=FORMATS, help="format of --load-dir")
    p.add_argument("--saver", required=True, choices=FORMATS, help="format to write to --save-dir")
    p.add_argument("--load-dir", required=True)
    p.add_argument("--save-dir", required=True, help="must not exist yet (or be an empty directory)")
    p.add_argument("--target-tensor-parallel-size", type=int, help="default: the source's (1 for hf)")
    p.add_argument("--target-pipeline-parallel-size", type=int, help="default: the source's (1 for hf)")
    vp = p.add_mutually_exclusive_group()
    vp.add_argument("--target-virtual-pipeline-model-parallel-size", type=int, help="virtual stages per pp rank")
    vp.add_argument("--target-num-layers-per-virtual-pipeline-stage", type=int)
    p.add_argument("--target-decoder-first-pipeline-num-layers", type=int)
    p.add_argument("--target-decoder-last-pipeline-num-layers", type=int)
    p.add_argument(
        "--target-expert-parallel-size",
        type=int,
        help="MoE, per-rank formats (megalite torch, megatron): "
        "files per EP rank (mp_rank_TT[_PPP]_EEE); default: the source's (1 for hf)",
    )
    p.add_argument(
        "--target-expert-tensor-parallel-size",
        type=int,
        help="MoE, megalite torch format: the expert TP the run will use (dividing the target tp; "
        "default: the source's, else the target tp)",
    )
    p.add_argument(
        "--ckpt-format",
        choices=format_names(),
        default=format_names()[0],
        help="megalite saver: layout-free sharded (default) or the per-rank torch format",
    )
    p.add_argument(
        "--target-format",
        choices=["torch", "torch_dist"],
        default="torch",
        help="megatron saver: Megatron-LM's legacy per-rank torch files (default) or Megatron-Core's "
        "torch_dist (layout-free; Megatron-LM's default --ckpt-format)",
    )
    p.add_argument(
        "--true-vocab-size",
        type=int,
        help="megatron loader: the unpadded vocabulary size, when the stored args do not say",
    )
    g = p.add_argument_group(
        "megatron loader: the run's tokenizer files where they are now (the args store "
        "the paths of the machine that saved it)"
    )
    g.add_argument("--vocab-file", help="GPT2BPETokenizer's vocab.json")
    g.add_argument("--merge-file", help="GPT2BPETokenizer's merges.txt")
    g.add_argument("--tokenizer-model", help="a SentencePiece .model or a Hugging Face tokenizer directory")
    p.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="hf loader: vocabulary padding of the megalite/Megatron model (default 128)",
    )
    return p.parse_args(argv)


def load_source(a: argparse.Namespace) -> ModelSource:
    """The loader asked for; a one-line CheckpointError when --load-dir is not of that kind."""
    if a.loader == "megalite":
        return MegaliteSource(a.load_dir)
    if a.loader == "megatron":
        # torch_dist (metadata.json + common.pt) or the legacy torch format (mp_rank_* folders)
        torch_dist = torch_dist_dir(a.load_dir) is not None
        files = {"vocab_file": a.vocab_file, "merge_file": a.merge_file, "tokenizer_model": a.tokenizer_model}
        src = (TorchDistSource if torch_dist else MegatronSource)(a.load_dir, a.true_vocab_size, tokenizer_files=files)
        if torch_dist:
            print(
                "reading a Megatron-Core torch_dist checkpoint: weights only (optimizer state is not converted)",
                flush=True,
            )
        note = getattr(src, "vocab_note", "")
        if src.vocab_guessed:
            print(
                f"warning: the Megatron args do not tell the vocabulary ({note}): keeping all "
                f"{src.cfg.vocab_size} (padded) rows; pass --true-vocab-size to drop the padding",
                file=sys.stderr,
            )
        elif note:
            print(f"vocabulary: {src.cfg.vocab_size} ids ({note})", flush=True)
        return src
    return HFSource(a.load_dir, a.make_vocab_size_divisible_by)


def target_layout(a: argparse.Namespace, src: ModelSource) -> Layout:
    """The target layout from the flags, defaulting to the source's own (tp = pp = 1 for hf)."""
    base = getattr(src, "layout", Layout())
    for flag in (
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "virtual_pipeline_model_parallel_size",
        "num_layers_per_virtual_pipeline_stage",
        "expert_parallel_size",
        "expert_tensor_parallel_size",
    ):  # 0 would silently mean "the source's"
        v = getattr(a, "target_" + flag)
        if v is not None and v < 1:
            raise CheckpointError(f"--target-{flag.replace('_', '-')} must be >= 1, got {v}")
    for flag in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        v = getattr(a, "target_" + flag)
        if v is not None and v < 0:
            raise CheckpointError(f"--target-{flag.replace('_', '-')} must be >= 0, got {v}")
    tp = a.target_tensor_parallel_size or base.tp
    pp = a.target_pipeline_parallel_size or base.pp
    explicit = a.target_tensor_parallel_size or a.target_pipeline_parallel_size
    vp = a.target_virtual_pipeline_model_parallel_size or 1
    if a.target_num_layers_per_virtual_pipeline_stage:
        per = a.target_num_layers_per_virtual_pipeline_stage
        if src.cfg.num_layers % (per * pp):
            raise CheckpointError(
                f"--target-num-layers-per-virtual-pipeline-stage {per} x pp {pp} does not divide "
                f"the model's {src.cfg.num_layers} layers"
            )
        vp = src.cfg.num_layers // (per * pp)
    elif not explicit and not a.target_virtual_pipeline_model_parallel_size:
        vp = base.vp
    first, last = a.target_decoder_first_pipeline_num_layers, a.target_decoder_last_pipeline_num_layers
    if not explicit and first is None and last is None:
        first, last = base.first, base.last
    for flag, v in (("tensor", tp), ("pipeline", pp), ("virtual pipeline", vp)):
        if v < 1:
            raise CheckpointError(f"the target {flag}-parallel size must be >= 1 (got {v})")
    # an explicit tp/pp/split asks for a new layout; otherwise the source's own split is kept
    stage_layers = (
        None
        if explicit or a.target_virtual_pipeline_model_parallel_size or a.target_num_layers_per_virtual_pipeline_stage
        else base.stage_layers
    )
    ep = a.target_expert_parallel_size or base.ep
    etp = a.target_expert_tensor_parallel_size or (base.etp if base.etp not in (None, base.tp) else None)
    return Layout(tp, pp, vp, first, last, stage_layers, ep, etp)


def check_moe_target(a: argparse.Namespace, src: ModelSource, layout: Layout) -> None:
    """One line for a mixture-of-experts conversion this converter cannot write (nothing written yet)."""
    moe = src.cfg.is_moe
    if moe and (isinstance(src, TorchDistSource) or (a.saver == "megatron" and a.target_format == "torch_dist")):
        raise CheckpointError(
            "mixture-of-experts models convert to and from Megatron-LM's legacy torch format "
            "(mp_rank_* folders), not torch_dist yet: use --target-format torch, or save the "
            "Megatron run with --ckpt-format torch"
        )
    if not moe or a.saver == "hf":
        return
    given = [
        f
        for f, v in (
            ("--target-expert-parallel-size", a.target_expert_parallel_size),
            ("--target-expert-tensor-parallel-size", a.target_expert_tensor_parallel_size),
        )
        if v
    ]
    if a.saver == "megalite" and format_info(a.ckpt_format).layout_free and given:
        raise CheckpointError(
            f"{given[0]} sets the files of a per-rank format, but the sharded format is "
            f"layout-free (it loads at any ep and etp): drop it, or add --ckpt-format torch"
        )
    etp = layout.expert_tp
    if a.saver == "megatron" and etp != layout.tp:
        raise CheckpointError(
            f"--saver megatron writes experts split like the dense layers (expert tp = tp = "
            f"{layout.tp}); --target-expert-tensor-parallel-size {etp} is not supported there"
        )
    if a.saver == "megalite" and format_info(a.ckpt_format).files_per_tp_rank and layout.tp % etp:
        raise CheckpointError(
            f"the torch format holds an expert tp rank's shard in the file of tp rank t = that "
            f"rank mod etp, so etp must divide tp ({layout.tp}); got {etp}: use --ckpt-format "
            f"sharded, which loads into any layout"
        )


def tokenizer_for_target(a: argparse.Namespace, src: ModelSource, final: str, tmp: str) -> Dict[str, Optional[str]]:
    """Tokenizer fields the target records; HF tokenizer files are copied into ``tmp/tokenizer``."""
    if src.info.tokenizer_files and a.saver != "hf":
        os.makedirs(os.path.join(tmp, "tokenizer"))
        for path in src.info.tokenizer_files:
            shutil.copy(path, os.path.join(tmp, "tokenizer", os.path.basename(path)))
        return tokenizer_fields(src.info.tokenizer_files, os.path.abspath(os.path.join(final, "tokenizer")))
    return {k: v for k, v in src.info.tokenizer.items() if v}


def copy_hf_tokenizer(src: ModelSource, out: str) -> str:
    """Copy the tokenizer files an HF folder uses; returns what was done, for the log."""
    tok = src.info.tokenizer
    copied = []
    if src.info.tokenizer_files:
        for path in src.info.tokenizer_files:
            shutil.copy(path, out)
            copied.append(os.path.basename(path))
    elif tok.get("tokenizer_type") == "GPT2BPETokenizer" and all(
        tok.get(k) and os.path.exists(tok[k]) for k in ("vocab_file", "merge_file")
    ):
        shutil.copy(tok["vocab_file"], os.path.join(out, "vocab.json"))
        shutil.copy(tok["merge_file"], os.path.join(out, "merges.txt"))
        end = "<|endoftext|>"
        with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
            json.dump(
                {
                    "tokenizer_class": "GPT2Tokenizer",
                    "model_max_length": src.cfg.max_positions,
                    "bos_token": end,
                    "eos_token": end,
                    "unk_token": end,
                },
                f,
                indent=2,
            )
        copied = ["vocab.json", "merges.txt", "tokenizer_config.json"]
    elif tok.get("tokenizer_type") == "HuggingFaceTokenizer" and tok.get("tokenizer_model"):
        model = tok["tokenizer_model"]
        names = [os.path.join(model, n) for n in TOKENIZER_FILES] if os.path.isdir(model) else [model]
        for path in names:
            if os.path.isfile(path):
                shutil.copy(path, out)
                copied.append(os.path.basename(path))
    elif (
        tok.get("tokenizer_type") in ("SentencePieceTokenizer", "Llama2Tokenizer")
        and tok.get("tokenizer_model")
        and os.path.isfile(tok["tokenizer_model"])
    ):
        shutil.copy(tok["tokenizer_model"], os.path.join(out, "tokenizer.model"))
        copied = ["tokenizer.model"]
    return f"copied {', '.join(copied)}" if copied else "none known: add the tokenizer files yourself"


def prepare_target(save_dir: str) -> str:
    """The temporary directory to write into; refuses a non-empty --save-dir (nothing is overwritten)."""
    if os.path.isfile(save_dir) or (os.path.isdir(save_dir) and os.listdir(save_dir)):
        raise CheckpointError(f"--save-dir {save_dir} already exists and is not empty; choose a new directory")
    tmp = save_dir.rstrip("/") + ".tmp-convert"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a conversion that was killed
    return tmp


def convert(a: argparse.Namespace) -> None:
    """Check everything, then stream the source into a temporary target and rename it into place."""
    started = time.time()
    if a.target_format == "torch_dist" and a.saver != "megatron":
        raise CheckpointError(
            "--target-format torch_dist is a format of --saver megatron (megalite's own are "
            "--ckpt-format sharded/torch)"
        )
    src = load_source(a)
    layout = target_layout(a, src) if a.saver != "hf" else Layout()
    if a.saver == "hf":
        architecture_for(src.cfg)
    check_fits(src.cfg, layout)
    check_moe_target(a, src, layout)
    tmp = prepare_target(a.save_dir)
    cfg = src.cfg
    total = cfg.num_layers + 2
    print(
        f"converting {a.loader} -> {a.saver}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_attention_heads} heads / {cfg.query_groups} query groups, vocab {cfg.vocab_size}"
        + (
            f"; {cfg.num_experts} experts (top-{cfg.moe_router_topk}) in {cfg.num_moe_layers} layers"
            if cfg.is_moe
            else ""
        )
        + (f"; target tp={layout.tp} pp={layout.pp} vp={layout.vp}" if a.saver != "hf" else "")
        + (f" ep={layout.ep} etp={layout.expert_tp}" if a.saver != "hf" and cfg.is_moe else ""),
        flush=True,
    )
    done = [0]

    def progress(what: str) -> None:
        done[0] += 1
        print(f"  [{done[0]:>{len(str(total))}}/{total}] {what} ({time.time() - started:.1f} s)", flush=True)

    try:
        if a.saver == "hf":
            save_hf(src, tmp, progress)
            note = copy_hf_tokenizer(src, tmp)
        else:
            os.makedirs(tmp)
            tok = tokenizer_for_target(a, src, a.save_dir, tmp)
            if a.saver == "megatron":
                save = save_torch_dist if a.target_format == "torch_dist" else save_megatron
                save(src, tmp, layout, tok, progress, getattr(src, "args", None))
            else:
                megalite_writer(a.ckpt_format)(src, tmp, layout, tok, progress)
            note = (
                f"{tok.get('tokenizer_type')} recorded"
                if tok
                else (
                    f"none found in {a.load_dir}, none recorded; tools/generate.py then reads and writes token ids "
                    f"(as --tokenizer-type NullTokenizer --vocab-size {cfg.vocab_size}); for text give it "
                    f"--tokenizer-type with its files (e.g. HuggingFaceTokenizer --tokenizer-model DIR)"
                )
            )
        src.close()
        if os.path.isdir(a.save_dir):
            os.rmdir(a.save_dir)  # empty, checked above
        os.replace(tmp, a.save_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"tokenizer: {note}")
    print(f"wrote {a.save_dir} in {time.time() - started:.1f} s")


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        convert(a)
    except CheckpointError as e:
        print(f"convert.py: error: {e}", file=sys.stderr)
        return 1
    except (OSError, ValueError, KeyError) as e:
        print(f"convert.py: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
