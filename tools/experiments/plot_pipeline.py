"""Draw pipeline schedules: one panel per schedule, stages on the y axis, time on the x
axis (one unit = a stage's forward of one microbatch: an op of an interleaved schedule
runs one of the stage's V chunks and lasts 1/V; a tick is its forward slot, then its
backward slot, each drawn where some stage uses it), forward ops in blue and backward ops in
orange (lighter shades for later virtual stages), each cell labelled with its
microbatch, idle cells blank; the panel title gives the schedule table's bubble fraction
next to the textbook value and the activation slots a stage keeps (in chunks).

    python tools/experiments/plot_pipeline.py [--stages 4] [--microbatches 8] [--virtual 2] [-o pipeline.png]

The tables are the ones the trainer runs (olmo_jax/parallel/pipeline/schedule.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from olmo_jax.parallel.pipeline import schedule as sched_lib  # noqa: E402
from olmo_jax.report.pipeline_view import schedule_cells  # noqa: E402

COLORS = {"F": ("#1f77b4", "#9ecae1"), "B": ("#ff7f0e", "#fdd0a2")}  # by pipeline_view.KIND


def _columns(s: sched_lib.Schedule):
    """Per tick, the x offset of its F slot and of its B slot (in units of one op) and
    the tick's width: the slots some stage uses, side by side."""
    used = (s.table[..., sched_lib.COL["op"]] != sched_lib.IDLE).any(axis=2)  # [ticks, 2]
    x, out = 0.0, []
    for f_used, b_used in used:
        out.append((x, x + (1 if f_used else 0)))
        x += int(f_used) + int(b_used)
    return out, x


def draw(ax, s: sched_lib.Schedule, width: float) -> None:
    dt = 1.0 / s.virtual
    shades = [i / max(1, s.virtual - 1) for i in range(s.virtual)]
    offsets, _ = _columns(s)
    for c in schedule_cells(s):
        dark, light = COLORS[c["kind"]]
        v = c["virtual"]
        color = matplotlib.colors.to_rgb(dark) if v == 0 else tuple(
            (1 - shades[v]) * a + shades[v] * b
            for a, b in zip(matplotlib.colors.to_rgb(dark), matplotlib.colors.to_rgb(light),
                            strict=True))
        x = offsets[c["tick"]][c["slot"]] * dt
        ax.add_patch(Rectangle((x, c["stage"]), dt, 1, facecolor=color, edgecolor="white",
                               linewidth=0.6))
        ax.text(x + 0.5 * dt, c["stage"] + 0.5, str(c["microbatch"]), ha="center", va="center",
                fontsize=7 if dt == 1 else 6, color="white" if v == 0 else "black")
    ax.set_xlim(0, width)
    ax.set_ylim(s.stages, 0)
    ax.set_yticks([i + 0.5 for i in range(s.stages)], [f"stage {i}" for i in range(s.stages)])
    ax.set_xlabel("time (one stage forward of one microbatch = 1)")
    textbook = sched_lib.textbook_bubble(s.kind, s.stages, s.microbatches, s.virtual)
    ax.set_title(f"{s.kind}: P={s.stages}, V={s.virtual}, M={s.microbatches}; bubble "
                 f"{s.bubble:.3f} (textbook {textbook:.3f}); activation slots per stage "
                 f"{s.slots['stash']} chunk(s) of 1/{s.virtual} stage", fontsize=9)


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--virtual", type=int, default=2, help="virtual stages of interleaved_1f1b")
    p.add_argument("-o", "--out", type=Path, default=Path("pipeline.png"))
    args = p.parse_args(argv)
    schedules = [
        sched_lib.build("gpipe", args.stages, 1, args.microbatches),
        sched_lib.build("1f1b", args.stages, 1, args.microbatches),
        sched_lib.build("interleaved_1f1b", args.stages, args.virtual, args.microbatches),
    ]
    width = max(_columns(s)[1] / s.virtual for s in schedules)
    fig, axes = plt.subplots(len(schedules), 1, figsize=(max(8.0, 0.4 * width),
                                                         1.0 + (0.9 + 0.35 * args.stages) * len(schedules)))
    for ax, s in zip(axes, schedules, strict=True):
        draw(ax, s, width)
    fig.legend(handles=[Rectangle((0, 0), 1, 1, color=COLORS["F"][0], label="forward"),
                        Rectangle((0, 0), 1, 1, color=COLORS["B"][0], label="backward"),
                        Rectangle((0, 0), 1, 1, color=COLORS["F"][1],
                                  label="later virtual stage")],
               loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return args.out


if __name__ == "__main__":
    main()
