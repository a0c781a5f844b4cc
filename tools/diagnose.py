"""Name the rank a hung or dead job waited for, from the flight-recorder files its ranks wrote.

    python tools/diagnose.py DIR          # DIR: the run's --debug-dir (default <--save>/debug)

Every rank writes ``flight_recorder_rank_<N>.json`` (its last events, what it waits in, its
per-group collective counts and its schedule's transfers) when a wait passes
--distributed-timeout-minutes, when the job is ended by a signal, or on SIGUSR1. This rebuilds the
diagnosis the job printed (megalite.observability.diagnosis: the same analysis), for jobs that died too hard to
print it: a rank without a current file is one that stopped or died. Prints the diagnosis and one
line per rank; exit 1 when there is no file to read, 2 on bad input (one line: a bad flag, or a file
that is JSON but not a flight-recorder dump). When every rank left a record and none waited longer
than --min-wait seconds, the job was not hung (e.g. a healthy job ended by a signal).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.config.cli import OneLineArgumentParser, number  # noqa: E402
from megalite.observability.diagnosis import DumpError, diagnose, rank_table, read_dumps  # noqa: E402


def main(argv=None) -> int:
    parser = OneLineArgumentParser(prog="diagnose.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="the run's --debug-dir")
    parser.add_argument("--events", type=number(int, ge=1), default=3, help="last events shown per rank")
    parser.add_argument(
        "--min-wait",
        type=number(ge=0),
        default=1.0,
        help="when every rank left a record, waits "
        "shorter than this many seconds count as progress (files of a healthy job ended by a signal)",
    )
    args = parser.parse_args(argv)
    try:
        snaps, world, notes, problems = read_dumps(args.directory)
    except DumpError as e:
        print(f"diagnose.py: error: {e}", file=sys.stderr)
        return 2
    for p in problems:
        print(f"diagnose.py: {p}", file=sys.stderr)
    if not snaps:
        return 1
    min_wait = args.min_wait if len(snaps) == world else 0.0
    print(f"diagnosis: {diagnose(snaps, world, notes, min_wait)}")
    print(f"ranks ({len(snaps)} of {world} with a current record):")
    for line in rank_table(snaps, world, args.events):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
