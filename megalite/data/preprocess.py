"""Streaming jsonl -> ``{prefix}_{key}_document.bin/.idx`` preprocessing (Megatron format).

The input is read line by line (plain or gzip), in batches handed to a pool
of tokenizer processes; results come back in input order and are streamed to
one IndexedDatasetBuilder per json key. Memory is bounded: at most
``_INFLIGHT_PER_WORKER`` batches per worker are in flight, and only the
per-sequence lengths (4 bytes each) stay resident.

Wherever Megatron-LM's tools/preprocess_data.py succeeds, the output is its
output byte for byte (same tokenizer):

* a line is a document; one whose text tokenizes to nothing is still
  written, as a document with no sequences (the .idx document index repeats
  an entry), not dropped;
* a JSON list value is a document of sentences, one sequence each (what
  Megatron's ``--split-sentences`` stage writes); sentences that tokenize to
  nothing are left out; eod goes at the end of the last sequence, and only
  when the document has tokens;
* lines end at ``\\n``, ``\\r\\n`` or ``\\r`` (Megatron reads in text mode);
* with P partitions, line i goes to partition i mod P, or with
  ``keep_sequential_samples`` the lines go in P consecutive runs of
  ceil(lines / P); the partitions are concatenated in order.

Where Megatron stops with a traceback, this reports or repairs instead:

* a line that is not JSON, not an object, lacks a key, or whose value is not
  a string or list of strings stops the run with ``file:line: reason``; with
  ``skip_invalid`` it is skipped and counted;
* blank lines are ignored;
* bytes that are not UTF-8, and lone surrogates from JSON escapes, are
  replaced by U+FFFD / "?" and the affected lines counted;
* outputs live under temporary names until the end (see IndexedDatasetBuilder).
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import multiprocessing as mp
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Callable, Iterable, Iterator, Optional

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
    keep_sequential_samples: bool = False
    log_interval: int = 10000
    skip_invalid: bool = False
    vocab_size: Optional[int] = None  # NullTokenizer only


@dataclass
class PreprocessStats:
    """Counters reported at the end (and merged across partitions)."""

    lines: int = 0
    documents: dict = field(default_factory=dict)  # key -> documents written (empty included)
    tokens: dict = field(default_factory=dict)  # key -> tokens written
    bytes_read: int = 0
    invalid_skipped: int = 0
    empty_documents: int = 0  # written with no sequences, as Megatron writes them
    utf8_replaced: int = 0
    seconds: float = 0.0

    def merge(self, other: "PreprocessStats") -> None:
        """Add another partition's counters to these (seconds are left to the caller)."""
        for name in ("lines", "bytes_read", "invalid_skipped", "empty_documents", "utf8_replaced"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for key, n in other.documents.items():
            self.documents[key] = self.documents.get(key, 0) + n
        for key, n in other.tokens.items():
            self.tokens[key] = self.tokens.get(key, 0) + n

    def summary(self) -> str:
        """One human-readable line: counts and throughput."""
        secs = max(self.seconds, 1e-9)
        ntok = sum(self.tokens.values())
        return (
            f"{self.lines} lines, documents {self.documents}, tokens {ntok}; "
            f"{self.empty_documents} empty (kept as empty documents, as Megatron does); "
            f"skipped {self.invalid_skipped} invalid; "
            f"{self.utf8_replaced} lines with invalid UTF-8 replaced; "
            f"{self.seconds:.1f}s, {self.lines / secs:.0f} docs/s, "
            f"{self.bytes_read / secs / 1e6:.2f} MB/s, {ntok / secs:.0f} tokens/s"
        )


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron's output naming: ``{prefix}_{key}_document``."""
    return f"{output_prefix}_{key}_document"


def open_binary(path: str) -> IO[bytes]:
    """Open .jsonl or .jsonl.gz (by extension) for binary line reading."""
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb", buffering=1 << 20)


def iter_lines(f: IO[bytes]) -> Iterator[bytes]:
    """Raw lines ending at \\n, \\r\\n or \\r: the lines Python's text mode (Megatron's) sees.

    Binary iteration splits at \\n only; a line holding a bare \\r is rare,
    so it alone pays for the second split.
    """
    for raw in f:
        if b"\r" in raw:
            yield from raw.splitlines(keepends=True)
        else:
            yield raw


# ---------------------------------------------------------------- worker side
_W: dict = {}


def _init_worker(opts: PreprocessOptions) -> None:
    tok = build_tokenizer(opts.tokenizer, opts.vocab_size)
    _W.update(tok=tok, keys=opts.json_keys, eod=opts.append_eod, dtype=optimal_dtype(tok.vocab_size))


def _parse_line(raw: bytes, keys: tuple) -> tuple[Optional[dict], Optional[str], bool]:
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
    for k in keys:
        if k not in obj:
            return None, f"missing key {k!r} (keys present: {sorted(obj)[:8]})", bad
        v = obj[k]
        if isinstance(v, list):
            wrong = next((s for s in v if not isinstance(s, str)), None)
            if wrong is not None:
                return None, (f"key {k!r} is a list holding {type(wrong).__name__}, expected strings (sentences)"), bad
        elif not isinstance(v, str):
            return None, f"key {k!r} is {type(v).__name__}, not a string", bad
    return obj, None, bad


def _tokenize_document(value, bad: bool) -> tuple[list[int], list[int], bool]:
    """Megatron's Encoder.encode for one key: (ids, sequence lengths, had bad UTF-8)."""
    tok = _W["tok"]
    ids: list[int] = []
    lengths: list[int] = []
    for sentence in value if isinstance(value, list) else (value,):
        try:
            sentence.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates from "\udXXX" escapes
            sentence, bad = sentence.encode("utf-8", "replace").decode("utf-8"), True
        piece = tok.tokenize(sentence)
        if piece:
            ids += piece
            lengths.append(len(piece))
    if ids and _W["eod"]:
        ids.append(tok.eod)
        lengths[-1] += 1
    return ids, lengths, bad


def _encode_batch(batch: list[tuple[int, bytes]]) -> list[tuple]:
    """Tokenize a batch of (line number, raw line); one result tuple per line.

    Result: (lineno, error or None, bad_utf8, [(token bytes, lengths) per key]).
    """
    keys, dtype = _W["keys"], _W["dtype"]
    out = []
    for lineno, raw in batch:
        obj, err, bad = _parse_line(raw, keys)
        if err is not None:
            out.append((lineno, err, bad, None))
            continue
        encoded = []
        for k in keys:
            try:
                ids, lengths, bad = _tokenize_document(obj[k], bad)
            except ValueError as e:  # e.g. NullTokenizer given a non-integer
                err = f"key {k!r}: {e}"
                break
            encoded.append((np.asarray(ids, dtype=dtype).tobytes(), lengths))
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


# A partition's share of the lines: take(i) says whether 0-based line i is
# ours, done(i) that no later line is (so reading can stop).
Selection = tuple[Callable[[int], bool], Callable[[int], bool]]
_ALL: Selection = (lambda i: True, lambda i: False)


def _batches(f: IO[bytes], select: Selection, throttle: _Throttle, counter: list) -> Iterator[list]:
    """Yield batches of (1-based line number, bytes), blocking while too many are in flight."""
    take, done = select
    batch, size = [], 0
    for i, raw in enumerate(iter_lines(f)):
        if not take(i):
            if done(i):
                break
            continue
        counter[0] += len(raw)
        if raw.strip():
            batch.append((i + 1, raw))
            size += len(raw)
        if len(batch) >= _BATCH_LINES or size >= _BATCH_BYTES:
            if not throttle.acquire():
                return
            yield batch
            batch, size = [], 0
    if batch and throttle.acquire():
        yield batch


def _map_results(opts: PreprocessOptions, batches: Iterable[list]) -> Iterator[list]:
    if opts.workers <= 1:
        _init_worker(opts)
        yield from map(_encode_batch, batches)
        return
    with mp.Pool(opts.workers, initializer=_init_worker, initargs=(opts,)) as pool:
        yield from pool.imap(_encode_batch, batches)


def _write_document(builder: IndexedDatasetBuilder, data: bytes, lengths: list[int]) -> None:
    """One document: its sequences (none for an empty one), then its end."""
    if len(lengths) == 1:
        builder.add_raw(data, lengths[0])
    else:
        step, off = builder.dtype.itemsize, 0
        for n in lengths:
            builder.add_raw(data[off : off + n * step], n)
            off += n * step
    builder.end_document()


def _consume(
    opts: PreprocessOptions,
    results_iter: Iterator[list],
    throttle: _Throttle,
    builders: dict,
    stats: PreprocessStats,
    progress: Callable[[], None],
) -> None:
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
            for k, (data, lengths) in zip(opts.json_keys, encoded):
                _write_document(builders[k], data, lengths)
                stats.documents[k] += 1
                stats.tokens[k] += sum(lengths)
                stats.empty_documents += not lengths
        progress()


def _run_single(opts: PreprocessOptions, out_prefix: str, select: Selection = _ALL) -> PreprocessStats:
    """Process the lines ``select`` picks from the input into ``out_prefix``."""
    vocab = build_tokenizer(opts.tokenizer, opts.vocab_size).vocab_size
    stats = PreprocessStats(documents={k: 0 for k in opts.json_keys}, tokens={k: 0 for k in opts.json_keys})
    builders = {
        k: IndexedDatasetBuilder(output_prefix_for(out_prefix, k), optimal_dtype(vocab)) for k in opts.json_keys
    }
    throttle = _Throttle(_INFLIGHT_PER_WORKER * max(1, opts.workers))
    counter, t0, next_log = [0], time.time(), [opts.log_interval]

    def progress() -> None:
        if opts.log_interval and stats.lines >= next_log[0]:
            next_log[0] += opts.log_interval
            stats.bytes_read, stats.seconds = counter[0], time.time() - t0
            logger.info("processed %s", stats.summary())

    f = open_binary(opts.input)
    results_iter = _map_results(opts, _batches(f, select, throttle, counter))
    try:
        with f:
            _consume(opts, results_iter, throttle, builders, stats, progress)
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


def _count_lines(path: str) -> int:
    """Lines as Megatron counts them for --keep-sequential-samples (text-mode lines)."""
    with open_binary(path) as f:
        return sum(1 for _ in iter_lines(f))


def partition_selection(parts: int, index: int, run: Optional[int]) -> Selection:
    """Megatron's share of the input lines for partition ``index`` of ``parts``.

    ``run`` None: round robin over every line, blank ones included. Otherwise
    the lines [index * run, (index + 1) * run), run = ceil(lines / parts).
    """
    if run is None:
        return (lambda i: i % parts == index), (lambda i: False)
    return (lambda i: index * run <= i < (index + 1) * run), (lambda i: i >= (index + 1) * run)


def _partition_main(opts: PreprocessOptions, prefix: str, index: int, run: Optional[int], conn) -> None:
    try:
        select = partition_selection(opts.partitions, index, run)
        conn.send(("ok", _run_single(opts, prefix, select)))
    except BaseException as e:  # forwarded to the parent, which re-raises
        conn.send(("error", f"{e}"))
    finally:
        conn.close()


def _run_partitioned(opts: PreprocessOptions) -> PreprocessStats:
    """Each partition reads the whole input for its own lines (Megatron's order), then merge."""
    per = PreprocessOptions(**{**opts.__dict__, "workers": max(1, opts.workers // opts.partitions)})
    prefixes = [f"{opts.output_prefix}.part{i}-{os.getpid()}" for i in range(opts.partitions)]
    run = max(1, math.ceil(_count_lines(opts.input) / opts.partitions)) if opts.keep_sequential_samples else None
    procs, stats, errors = [], PreprocessStats(), []
    for i, prefix in enumerate(prefixes):
        recv, send = mp.Pipe(duplex=False)
        proc = mp.Process(target=_partition_main, args=(per, prefix, i, run, send))
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
        if errors:  # the error of the earliest line, as a single pass would report
            raise PreprocessError(min(errors, key=_error_line))
        for k in opts.json_keys:
            merge_datasets([output_prefix_for(p, k) for p in prefixes], output_prefix_for(opts.output_prefix, k))
    finally:
        for p in prefixes:
            for k in opts.json_keys:
                for ext in (".bin", ".idx"):
                    path = output_prefix_for(p, k) + ext
                    if os.path.exists(path):
                        os.remove(path)
    return stats


def _error_line(message: str) -> float:
    """The line number of a ``file:line: reason`` message (inf when it has none)."""
    head = message.split(": ", 1)[0]
    number = head.rsplit(":", 1)[-1]
    return int(number) if number.isdigit() else math.inf


def check_output_prefix(prefix: str) -> None:
    """A one-line ValueError unless ``prefix``'s directory is or can become writable (checked before any work)."""
    directory = os.path.dirname(os.path.abspath(prefix))
    existing = directory
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(
            f"--output-prefix {prefix}: {existing} is a file, not a directory; give a prefix in a directory"
        )
    try:
        os.makedirs(directory, exist_ok=True)
        tempfile.TemporaryFile(dir=directory).close()  # also catches what os.access misjudges (root, ro mounts)
    except OSError as e:
        raise ValueError(
            f"--output-prefix {prefix}: cannot write in {directory} ({e.strerror or e}); give a "
            "prefix in a writable directory"
        ) from None


def preprocess(opts: PreprocessOptions) -> PreprocessStats:
    """Run preprocessing; return the final counters (see module docstring for policy)."""
    if not os.path.isfile(opts.input):
        raise FileNotFoundError(f"--input {opts.input}: file not found")
    if opts.partitions < 1 or opts.workers < 1:
        raise ValueError("--workers and --partitions must be at least 1")
    check_output_prefix(opts.output_prefix)
    t0 = time.time()
    if opts.partitions > 1:
        stats = _run_partitioned(opts)
    else:
        stats = _run_single(opts, opts.output_prefix)
    stats.seconds = time.time() - t0
    return stats
