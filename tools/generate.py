#!/usr/bin/env python
"""Generate text from a megalite checkpoint in one process, with a KV cache.

Examples:
  python tools/generate.py --load ckpt --prompt "The for statement" --max-new-tokens 40 --greedy
  python tools/generate.py --load ckpt --prompt "Lists are" --temperature 0.8 --top-k 50 --top-p 0.9 --seed 7

The checkpoint may be in either format (sharded or torch) and any tp/pp/vp layout:
its model shape and tokenizer come from the run's config stored with it (the
default run's tokenizer is rebuilt if its cache is gone); the tokenizer flags
override the stored ones. The continuation is printed on stdout (without the
prompt, up to eod); how long it took goes to stderr.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megalite.checkpointing import CheckpointError  # noqa: E402
from megalite.config import ConfigError  # noqa: E402
from megalite.config.cli import OneLineArgumentParser, add_load_args, one_line  # noqa: E402
from megalite.data.tokenizers import TOKENIZER_TYPES  # noqa: E402
from megalite.inference import Sampling, build_model, generate, read_checkpoint, run_tokenizer  # noqa: E402


def parse_args(argv: Optional[Sequence[str]] = None):
    p = OneLineArgumentParser(prog="generate.py", description=__doc__.split("\n")[0])
    add_load_args(p)
    g = p.add_argument_group("generation")
    g.add_argument("--prompt", default="", help="text to continue (empty: start a new document after eod)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--greedy", action="store_true", help="always the most likely token")
    g.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    g.add_argument("--top-p", type=float, default=1.0, help="sample among the most likely tokens holding p (1: all)")
    g.add_argument("--seed", type=int, default=1234, help="the same seed gives the same text")
    g.add_argument("--no-kv-cache", action="store_true", help="rerun the whole sequence at every step")
    g = p.add_argument_group("tokenizer (default: the run's)")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file")
    g.add_argument("--merge-file")
    g.add_argument("--tokenizer-model")
    g.add_argument(
        "--vocab-size",
        type=int,
        help="NullTokenizer: ids 0..N-1 and eod N (default: the model's "
        "vocabulary less one, or all of it when no tokenizer is recorded)",
    )
    return p.parse_args(argv)


def _prompt_ids(text: str, tokenizer, vocab: int, limit: int, max_new: int) -> List[int]:
    """The prompt's ids, checked against the model's vocabulary and positions."""
    try:
        ids = tokenizer.tokenize(text) if text else []
    except (ValueError, KeyError) as e:
        raise ValueError(f"--prompt cannot be tokenized by the {type(tokenizer).__name__}: {one_line(e)}") from None
    if not ids:  # unconditional: what follows an end of document
        if not 0 <= tokenizer.eod < vocab:
            raise ValueError("an empty --prompt starts after eod, which this run's tokenizer lacks; give --prompt")
        ids = [tokenizer.eod]
    if max(ids) >= vocab:
        raise ValueError(
            f"the prompt holds token id {max(ids)}, outside the model's vocabulary of {vocab}: "
            f"the tokenizer flags do not match the run's"
        )
    if len(ids) >= limit:
        raise ValueError(
            f"the prompt is {len(ids)} tokens; the model holds at most {limit} positions "
            f"(its --max-position-embeddings / --seq-length): shorten --prompt"
        )
    if len(ids) + max_new > limit:
        raise ValueError(
            f"the prompt ({len(ids)} tokens) plus --max-new-tokens {max_new} exceeds the model's "
            f"{limit} positions: lower --max-new-tokens to {limit - len(ids)}"
        )
    return ids


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point; returns the process exit code (2 for bad input, with one line on stderr)."""
    args = parse_args(argv)
    try:
        sampling = Sampling(args.greedy, args.temperature, args.top_k, args.top_p).check()
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        cfg, iteration, full = read_checkpoint(args.load, args.ckpt_step)
        tokenizer = run_tokenizer(
            cfg,
            {
                "tokenizer_type": args.tokenizer_type,
                "vocab_file": args.vocab_file,
                "merge_file": args.merge_file,
                "tokenizer_model": args.tokenizer_model,
                "vocab_size": args.vocab_size,
            },
        )
        if not cfg.data.tokenizer_type and not args.tokenizer_type:
            print(
                f"note: the checkpoint records no tokenizer: the prompt and the output are token ids "
                f"(0..{cfg.model.vocab_size - 1}); for text give --tokenizer-type and its files",
                file=sys.stderr,
            )
        prompt = _prompt_ids(args.prompt, tokenizer, cfg.model.vocab_size, cfg.model.max_positions, args.max_new_tokens)
        model = build_model(cfg, full, args.device, args.dtype)
    except (CheckpointError, ConfigError, ValueError, OSError) as e:
        print(f"generate.py: error: {one_line(e)}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    ids = generate(
        model,
        prompt,
        args.max_new_tokens,
        sampling,
        seed=args.seed,
        eod=tokenizer.eod,
        use_kv_cache=not args.no_kv_cache,
    )
    seconds = time.perf_counter() - t0
    text_ids = ids[:-1] if ids and ids[-1] == tokenizer.eod else ids
    print(tokenizer.detokenize(text_ids))
    print(
        f"generated {len(ids)} tokens after a {len(prompt)}-token prompt in {seconds:.3f} s "
        f"({len(ids) / seconds:.1f} tokens/s, KV cache {'off' if args.no_kv_cache else 'on'}); "
        f"checkpoint iteration {iteration}{', stopped at eod' if len(ids) > len(text_ids) else ''}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
