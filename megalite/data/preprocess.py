"""Streaming jsonl -> ``{prefix}_{key}_document.bin/.idx`` preprocessing (Megatron format).

The input is read line by line (plain or gzip), in batches handed to a pool
of tokenizer processes; results come back in input order and are streamed to
one IndexedDatasetBuilder per json key. Memory is bounded: at most
``_INFLIGHT_PER_WORKER`` batches per worker are in flight, and only the
per-document lengths (4 bytes each) stay resident.

Bad input policy:

* a line that is not JSON, not an object, lacks a key, or whose value is not
  a string stops the run with ``file:line: reason``; with ``skip_invalid`` it
  is skipped and counted;
* blank lines are ignored; documents that tokenize to nothing are skipped
  and counted (no empty sequences are written, before eod is appended);
* bytes that are not UTF-8, and lone surrogates from JSON escapes, are
  replaced by U+FFFD / "?" and the affected lines counted;
* outputs live under temporary names until the end (see IndexedDatasetBuilder).
"""
from __future__ import annotations

import gzip
import json
import logging
import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Iterable, Iterator, Optional

import numpy as np

from megalite.config import DataConfig
from megalite.data.indexed_dataset import IndexedDatasetBuilder, merge_datasets, optimal_dtype
from megalite.data.tokenizers import build_tokenizer

logger = logging.getLogger(__name__)

_BATCH_LINES = 256
_BATCH_BYTES = 1 << 20
_INFLIGHT_PER_WORKER = 4


class PreprocessError(ValueError):
    """Bad input that stops preprocessing; the message starts with ``file:line``."""


@dataclass
class PreprocessOptions:
    """Everything that defines one preprocessing run (picklable, for partitions)."""
    input: str
    output_prefix: str
    tokenizer: DataConfig
    json_keys: tuple[str, ...] = ("text",)
    append_eod: bool = False
    workers: int = 1
    partitions: int = 1
    log_interval: int = 10000
    skip_invalid: bool = False
    vocab_size: Optional[int] = None  # NullTokenizer only


@dataclass
class PreprocessStats:
    """Counters reported at the end (and merged across partitions)."""
    lines: int = 0
    documents: dict = field(default_factory=dict)  # key -> documents written
    tokens: dict = field(default_factory=dict)  # key -> tokens written
    bytes_read: int = 0
    invalid_skipped: int = 0
    empty_skipped: int = 0
    utf8_replaced: int = 0
    seconds: float = 0.0

    def merge(self, other: "PreprocessStats") -> None:
        """Add another partition's counters to these (seconds are left to the caller)."""
        for name in ("lines", "bytes_read", "invalid_skipped", "empty_skipped", "utf8_replaced"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for key, n in other.documents.items():
            self.documents[key] = self.documents.get(key, 0) + n
        for key, n in other.tokens.items():
            self.tokens[key] = self.tokens.get(key, 0) + n

    def summary(self) -> str:
        """One human-readable line: counts and throughput."""
        secs = max(self.seconds, 1e-9)
        ntok = sum(self.tokens.values())
        return (f"{self.lines} lines, documents {self.documents}, tokens {ntok}; "
                f"skipped {self.invalid_skipped} invalid, {self.empty_skipped} empty, "
                f"{self.utf8_replaced} lines with invalid UTF-8 replaced; "
                f"{self.seconds:.1f}s, {self.lines / secs:.0f} docs/s, "
                f"{self.bytes_read / secs / 1e6:.2f} MB/s, {ntok / secs:.0f} tokens/s")


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron's output naming: ``{prefix}_{key}_document``."""
    return f"{output_prefix}_{key}_document"


def open_binary(path: str) -> IO[bytes]:
    """Open .jsonl or .jsonl.gz (by extension) for binary line reading."""
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb", buffering=1 << 20)


def iter_json_texts(path: str, key: str = "text") -> Iterator[str]:
    """Yield ``obj[key]`` of each valid line of a jsonl file (bad lines silently skipped).

    For tokenizer training, where a stray bad line is not worth stopping for;
    a plain .txt file yields one text per line.
    """
    plain = not (path.endswith(".jsonl") or path.endswith(".json") or path.endswith(".jsonl.gz"))
    with open_binary(path) as f:
        for raw in f:
            line = raw.decode("utf-8", errors="replace")
            if plain:
                yield line
                continue
            try:
                value = json.loads(line)[key]
            except (ValueError, KeyError, TypeError, IndexError):
                continue
            if isinstance(value, str):
                yield value


# ---------------------------------------------------------------- worker side
_W: dict = {}


def _init_worker(opts: PreprocessOptions) -> None:
    tok = build_tokenizer(opts.tokenizer, opts.vocab_size)
    _W.update(tok=tok, keys=opts.json_keys, eod=opts.append_eod,
              dtype=optimal_dtype(tok.vocab_size))


def _parse_line(raw: bytes) -> tuple[Optional[dict], Optional[str], bool]:
    """Decode one line; return (object, error reason, had bad UTF-8)."""
    try:
        line, bad = raw.decode("utf-8"), False
    except UnicodeDecodeError:
        line, bad = raw.decode("utf-8", errors="replace"), True
    try:
        obj = json.loads(line)
    except ValueError as e:
        return None, f"invalid JSON ({e})", bad
    if not isinstance(obj, dict):
        return None, f"expected a JSON object, got {type(obj).__name__}", bad
    return obj, None, bad


def _encode_batch(batch: list[tuple[int, bytes]]) -> list[tuple]:
    """Tokenize a batch of (line number, raw line); one result tuple per line.

    Result: (lineno, error or None, bad_utf8, [(token bytes, n_tokens) per key]).
    """
    tok, keys, dtype = _W["tok"], _W["keys"], _W["dtype"]
    out = []
    for lineno, raw in batch:
        obj, err, bad = _parse_line(raw)
        if err is None:
            missing = [k for k in keys if k not in obj]
            wrong = [k for k in keys if k in obj and not isinstance(obj[k], str)]
            if missing:
                err = f"missing key {missing[0]!r} (keys present: {sorted(obj)[:8]})"
            elif wrong:
                err = f"key {wrong[0]!r} is {type(obj[wrong[0]]).__name__}, not a string"
        if err is not None:
            out.append((lineno, err, bad, None))
            continue
        encoded = []
        for k in keys:
            text = obj[k]
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # lone surrogates from "\udXXX" escapes
                text, bad = text.encode("utf-8", "replace").decode("utf-8"), True
            try:
                ids = tok.tokenize(text) if text else []
            except ValueError as e:  # e.g. NullTokenizer given a non-integer
                err = f"key {k!r}: {e}"
                break
            if ids and _W["eod"]:
                ids.append(tok.eod)
            encoded.append((np.asarray(ids, dtype=dtype).tobytes(), len(ids)))
        out.append((lineno, err, bad, None if err else encoded))
    return out


# ---------------------------------------------------------------- main side
class _Throttle:
    """Bounds the batches in flight: Pool.imap would otherwise read the whole input."""

    def __init__(self, limit: int):
        self.sem = threading.Semaphore(limit)
        self.stopped = False

    def acquire(self) -> bool:
        self.sem.acquire()
        return not self.stopped

    def stop(self) -> None:
        # Wakes a feeder blocked in acquire() so the pool can shut down.
        self.stopped = True
        self.sem.release()


def _batches(f: IO[bytes], start_line: int, end_offset: Optional[int],
             throttle: _Throttle, counter: list) -> Iterator[list]:
    """Yield batches of (lineno, bytes), blocking while too many are in flight."""
    batch, size, lineno = [], 0, start_line
    pos = f.tell() if end_offset is not None else 0
    for raw in f:
        lineno += 1
        counter[0] += len(raw)
        if end_offset is not None:
            pos += len(raw)
        if raw.strip():
            batch.append((lineno, raw))
            size += len(raw)
        if len(batch) >= _BATCH_LINES or size >= _BATCH_BYTES:
            if not throttle.acquire():
                return
            yield batch
            batch, size = [], 0
        if end_offset is not None and pos >= end_offset:
            break
    if batch and throttle.acquire():
        yield batch


def _map_results(opts: PreprocessOptions, batches: Iterable[list]) -> Iterator[list]:
    if opts.workers <= 1:
        _init_worker(opts)
        yield from map(_encode_batch, batches)
        return
    with mp.Pool(opts.workers, initializer=_init_worker, initargs=(opts,)) as pool:
        yield from pool.imap(_encode_batch, batches)


def _run_single(opts: PreprocessOptions, out_prefix: str, start: int = 0,
                end: Optional[int] = None, start_line: int = 0) -> PreprocessStats:
    """Process input bytes [start, end) (whole file by default) into ``out_prefix``."""
    vocab = build_tokenizer(opts.tokenizer, opts.vocab_size).vocab_size
    stats = PreprocessStats(documents={k: 0 for k in opts.json_keys},
                            tokens={k: 0 for k in opts.json_keys})
    builders = {k: IndexedDatasetBuilder(output_prefix_for(out_prefix, k), optimal_dtype(vocab))
                for k in opts.json_keys}
    throttle = _Throttle(_INFLIGHT_PER_WORKER * max(1, opts.workers))
    counter, t0, next_log = [0], time.time(), opts.log_interval
    f = open_binary(opts.input)
    if start:
        f.seek(start)
    results_iter = _map_results(opts, _batches(f, start_line, end, throttle, counter))
    try:
        with f:
            for results in results_iter:
                throttle.sem.release()
                for lineno, err, bad, encoded in results:
                    stats.lines += 1
                    stats.utf8_replaced += bad
                    if err is not None:
                        if not opts.skip_invalid:
                            raise PreprocessError(f"{opts.input}:{lineno}: {err}")
                        stats.invalid_skipped += 1
                        logger.debug("skipping %s:%d: %s", opts.input, lineno, err)
                        continue
                    for k, (data, n) in zip(opts.json_keys, encoded):
                        if n == 0:
                            stats.empty_skipped += 1
                            continue
                        builders[k].add_raw(data, n)
                        builders[k].end_document()
                        stats.documents[k] += 1
                        stats.tokens[k] += n
                if opts.log_interval and stats.lines >= next_log:
                    next_log += opts.log_interval
                    stats.bytes_read, stats.seconds = counter[0], time.time() - t0
                    logger.info("processed %s", stats.summary())
        for b in builders.values():
            b.finalize()
    except BaseException:
        throttle.stop()
        results_iter.close()  # shuts the pool down now, not at garbage collection
        for b in builders.values():
            b.abort()
        raise
    stats.bytes_read, stats.seconds = counter[0], time.time() - t0
    return stats


def _partition_ranges(path: str, parts: int) -> list[tuple[int, int]]:
    """Split a plain file into ``parts`` byte ranges that start at line starts."""
    size = os.path.getsize(path)
    cuts = [0]
    with open(path, "rb") as f:
        for i in range(1, parts):
            f.seek(max(cuts[-1], size * i // parts))
            f.readline()  # move to the start of the next line
            cuts.append(min(f.tell(), size))
    cuts.append(size)
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def _count_lines(path: str, end: int, chunk: int = 16 << 20) -> int:
    """Newlines in the first ``end`` bytes of a file, read in bounded chunks."""
    count, done = 0, 0
    with open(path, "rb") as f:
        while done < end:
            block = f.read(min(chunk, end - done))
            if not block:
                break
            count += block.count(b"\n")
            done += len(block)
    return count


def _partition_main(opts: PreprocessOptions, prefix: str, start: int, end: int, conn) -> None:
    try:
        start_line = _count_lines(opts.input, start)  # so messages carry true line numbers
        conn.send(("ok", _run_single(opts, prefix, start, end, start_line)))
    except BaseException as e:  # forwarded to the parent, which re-raises
        conn.send(("error", f"{e}"))
    finally:
        conn.close()


def _run_partitioned(opts: PreprocessOptions) -> PreprocessStats:
    ranges = _partition_ranges(opts.input, opts.partitions)
    per = PreprocessOptions(**{**opts.__dict__,
                               "workers": max(1, opts.workers // len(ranges))})
    prefixes = [f"{opts.output_prefix}.part{i}-{os.getpid()}" for i in range(len(ranges))]
    procs, stats, errors = [], PreprocessStats(), []
    for (start, end), prefix in zip(ranges, prefixes):
        recv, send = mp.Pipe(duplex=False)
        proc = mp.Process(target=_partition_main, args=(per, prefix, start, end, send))
        proc.start()
        send.close()  # so a child that dies makes recv() fail instead of blocking
        procs.append((proc, recv))
    for proc, recv in procs:
        try:
            status, payload = recv.recv()
        except EOFError:
            status, payload = "error", "a partition process died without a result"
        proc.join()
        if status == "ok":
            stats.merge(payload)
            stats.seconds = max(stats.seconds, payload.seconds)
        else:
            errors.append(payload)
    try:
        if errors:
            raise PreprocessError(errors[0])
        for k in opts.json_keys:
            merge_datasets([output_prefix_for(p, k) for p in prefixes],
                           output_prefix_for(opts.output_prefix, k))
    finally:
        for p in prefixes:
            for k in opts.json_keys:
                for ext in (".bin", ".idx"):
                    path = output_prefix_for(p, k) + ext
                    if os.path.exists(path):
                        os.remove(path)
    return stats


def preprocess(opts: PreprocessOptions) -> PreprocessStats:
    """Run preprocessing; return the final counters (see module docstring for policy)."""
    if not os.path.isfile(opts.input):
        raise FileNotFoundError(f"--input {opts.input}: file not found")
    t0 = time.time()
    if opts.partitions > 1 and opts.input.endswith(".gz"):
        logger.warning("--partitions ignored for gzip input (it cannot be split by offset)")
    if opts.partitions > 1 and not opts.input.endswith(".gz"):
        stats = _run_partitioned(opts)
    else:
        stats = _run_single(opts, opts.output_prefix)
    stats.seconds = time.time() - t0
    logger.info("done: %s", stats.summary())
    return stats
