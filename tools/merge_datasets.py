#!/usr/bin/env python
"""Concatenate Megatron .bin/.idx datasets (same dtype) into one.

Example:
  python tools/merge_datasets.py --input data/shards --output-prefix data/all_text_document
  python tools/merge_datasets.py --input a_text_document b_text_document --output-prefix ab
--input takes dataset prefixes, or one directory whose *.idx datasets are merged in
prefix order (Megatron's tools/merge_datasets.py order).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megalite.data.indexed_dataset import IndexFormatError, merge_datasets  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--input", nargs="+", required=True)
    p.add_argument("--output-prefix", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    prefixes = args.input
    if len(prefixes) == 1 and Path(prefixes[0]).is_dir():
        # Megatron's order: sorted by prefix, so "a" comes before "a-b" (sorting the
        # file names would put "a-b.idx" first, since "-" < ".")
        folder = Path(prefixes[0])
        prefixes = [str(folder / name) for name in sorted(f.name[:-4] for f in folder.glob("*.idx"))]
        if not prefixes:
            sys.exit(f"error: {folder}: no .idx files to merge")
    try:
        n = merge_datasets(prefixes, args.output_prefix)
    except (IndexFormatError, FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    print(f"merged {len(prefixes)} datasets, {n} sequences -> {args.output_prefix}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
