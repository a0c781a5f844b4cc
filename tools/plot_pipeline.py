"""Draw a pipeline timeline (one row per rank, one box per forward, backward or weight-gradient step).

From the simulator::

    python tools/plot_pipeline.py --schedule 1f1b --pp 4 --vp 1 --num-microbatches 8 --out timeline.png

From a real run's TIMELINE JSON (written by the executor)::

    python tools/plot_pipeline.py --timeline run_timeline.json --out timeline.png

``--print`` prints the text schedule (simulator mode) instead of / as well as
drawing; ``--save-json`` writes the simulated timeline. Forward boxes are
light, backward (B: input gradients, or the whole backward) dark and hatched,
zero-bubble weight-gradient steps (W) mid-tone with dots. The simulator times
a schedule with the executor's own semantics (``--mode executor``, default)
or the conservative rendezvous model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.analysis.simulate import MODES, simulate, timeline_bubble  # noqa: E402
from megalite.pipeline.actions import format_schedule  # noqa: E402
from megalite.pipeline.registry import SCHEDULES, build_schedule, layout_for  # noqa: E402

_HATCH = {"F": None, "B": "//", "W": ".."}


def _colour(mb: int, kind: str) -> tuple:
    """Same hue per micro-batch; forward light, weight gradient mid, backward dark."""
    import matplotlib

    base = matplotlib.colormaps["tab10"](mb % 10)[:3]
    if kind == "F":
        return tuple(0.55 * c + 0.45 for c in base)
    if kind == "W":
        return tuple(0.75 * c + 0.15 for c in base)
    return tuple(0.8 * c for c in base)


def plot_timeline(timeline: dict, out: str) -> None:
    """Render a TIMELINE dict to an image file ``out`` (PNG, SVG, PDF by suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    pp, vp, events = int(timeline["pp"]), int(timeline["vp"]), timeline["events"]
    t0 = min((e["start"] for e in events), default=0.0)
    t1 = max((e["end"] for e in events), default=1.0)
    fig, ax = plt.subplots(figsize=(max(8.0, min(40.0, len(events) / pp * 0.45)), 0.7 * pp + 1.6))
    for e in events:
        y = pp - 1 - e["rank"]  # rank 0 on top
        width = e["end"] - e["start"]
        ax.broken_barh(
            [(e["start"] - t0, width)],
            (y + 0.08, 0.84),
            facecolors=_colour(e["mb"], e["kind"]),
            edgecolors="black",
            linewidth=0.5,
            hatch=_HATCH.get(e["kind"]),
        )
        label = f"{e['mb']}" + (f".{e['chunk']}" if vp > 1 else "")
        ax.text(
            e["start"] - t0 + width / 2,
            y + 0.5,
            label,
            ha="center",
            va="center",
            fontsize=7,
            color="white" if e["kind"] == "B" else "black",
            fontweight="bold",
        )
    ax.set_yticks([pp - 1 - r + 0.5 for r in range(pp)], [f"rank {r}" for r in range(pp)])
    ax.set_ylim(0, pp)
    ax.set_xlim(0, t1 - t0)
    unit = "s" if timeline.get("source") == "measured" else "cost units"
    ax.set_xlabel(f"time ({unit})")
    bubble = timeline_bubble(timeline)
    mean_bubble = sum(bubble) / len(bubble) if bubble else 0.0
    ax.set_title(
        f"{timeline['schedule']}  p={pp} v={vp} m={timeline['m']}  "
        f"bubble={mean_bubble:.3f}  ({timeline.get('source', '?')})",
        loc="left",
    )
    handles = [
        Patch(facecolor="0.85", edgecolor="black", label="forward"),
        Patch(facecolor="0.45", edgecolor="black", hatch="//", label="backward"),
    ]
    if any(e["kind"] == "W" for e in events):
        handles[1] = Patch(facecolor="0.45", edgecolor="black", hatch="//", label="backward: input grads (B)")
        handles.append(Patch(facecolor="0.65", edgecolor="black", hatch="..", label="weight grads (W)"))
    ax.legend(
        handles=handles, loc="lower right", ncol=len(handles), fontsize=7, bbox_to_anchor=(1.0, 1.0), frameon=False
    )
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _schedules_help() -> str:
    """One line per registered schedule: its name and description."""
    width = max(len(name) for name in SCHEDULES)
    return "schedules:\n" + "\n".join(f"  {name:<{width}}  {spec.description}" for name, spec in SCHEDULES.items())


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=_schedules_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--schedule", choices=list(SCHEDULES), help="simulate this schedule (listed below)")
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--vp", type=int, default=1)
    p.add_argument("--num-microbatches", "-m", type=int, default=8)
    p.add_argument("--f-cost", type=float, default=1.0, help="forward cost of a whole rank")
    p.add_argument("--b-cost", type=float, default=2.0, help="backward cost of a whole rank")
    p.add_argument(
        "--w-cost",
        type=float,
        default=None,
        help="weight-gradient part of --b-cost in zero-bubble schedules (default: half)",
    )
    p.add_argument(
        "--mode",
        choices=MODES,
        default="executor",
        help="p2p semantics: the executor's (default) or conservative rendezvous",
    )
    p.add_argument("--timeline", help="TIMELINE JSON of a real (or saved) run")
    p.add_argument("--out", help="image to write (png/svg/pdf)")
    p.add_argument("--save-json", help="also write the simulated TIMELINE JSON here")
    p.add_argument("--print", action="store_true", help="print the text schedule")
    args = p.parse_args(argv)
    if (args.schedule is None) == (args.timeline is None):
        p.error("give exactly one of --schedule or --timeline")
    if args.timeline and args.print:
        p.error("--print needs --schedule (a timeline JSON holds no communication)")
    if not (args.out or args.print or args.save_json):
        p.error("nothing to do: give --out, --print or --save-json")
    return args


def _error(message: str) -> int:
    print(f"plot_pipeline.py: error: {message}", file=sys.stderr)
    return 2


def _matplotlib_missing() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return True
    return False


def _load_timeline(path: str) -> dict:
    """Read a TIMELINE JSON; ValueError with a one-line reason if it is not one."""
    try:
        with open(path) as f:
            timeline = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read --timeline {path}: {e.strerror}") from None
    except ValueError as e:
        raise ValueError(f"--timeline {path} is not JSON ({e})") from None
    missing = [
        k for k in ("schedule", "pp", "vp", "m", "events") if not isinstance(timeline, dict) or k not in timeline
    ]
    if missing:
        raise ValueError(
            f"--timeline {path} is not a TIMELINE (no {', '.join(missing)}); "
            "write one with pretrain_gpt.py --timeline-out or --save-json"
        )
    return timeline


def _simulate(args: argparse.Namespace) -> dict:
    actions = build_schedule(args.schedule, args.pp, args.vp, args.num_microbatches)
    if args.print:
        print(format_schedule(actions))
    result = simulate(
        actions,
        args.pp,
        args.vp,
        args.f_cost,
        args.b_cost,
        schedule=args.schedule,
        w_cost=args.w_cost,
        layout=layout_for(args.schedule, args.pp, args.vp),
        mode=args.mode,
    )
    print(f"makespan {result.makespan:.3f}  bubble {result.bubble_fraction}  peak in flight {result.peak_in_flight}")
    return result.to_timeline()


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the process exit code (2 with one line for bad input)."""
    args = _parse(argv)
    if args.out and _matplotlib_missing():  # before any work, not after the simulation
        return _error(
            "drawing --out needs matplotlib, which is not installed: "
            "pip install matplotlib (--print and --save-json work without it)"
        )
    try:
        timeline = _load_timeline(args.timeline) if args.timeline else _simulate(args)
    except ValueError as e:
        return _error(str(e))
    try:
        if args.save_json:
            with open(args.save_json, "w") as f:
                json.dump(timeline, f, indent=1)
        if args.out:
            plot_timeline(timeline, args.out)
            print(f"wrote {args.out}")
    except OSError as e:
        return _error(f"cannot write {e.filename or args.out}: {e.strerror}")
    except ValueError as e:  # matplotlib: unknown image format
        return _error(f"--out {args.out}: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
