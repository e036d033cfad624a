"""`jitney plot`: draw the seat chart from step traces (`jitney serve --trace`).

One column per trace. Top: seats x steps, each request its own colour, idle
seats white; a request keeps its seat from boarding to leaving. Below: the
seats in use and the tokens computed per step (prefill and decode), over
time.

matplotlib is the ``plot`` extra, not a serving dependency: it is imported
only here, when a chart is drawn.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

from jitney.scheduler.core.trace import read_trace

MISSING_MATPLOTLIB = ("jitney plot needs matplotlib, which is not installed: pip install 'jitney[plot]' "
                      "(in a checkout: make venv)")


def assign_seats(steps: list[dict[str, Any]]) -> tuple[list[list[int]], int]:
    """Per step, the seq id in each seat (0 = idle); and the number of seats.

    A request takes the lowest free seat when it first rides and keeps it
    while it rides; a step it sits out (it waits for a sample in flight, or
    was preempted) frees the seat.
    """
    seat_of: dict[int, int] = {}
    rows: list[list[int]] = []
    for step in steps:
        riding = set(step["seats"])
        for seq in [s for s in seat_of if s not in riding]:
            del seat_of[seq]
        taken = set(seat_of.values())
        for seq in step["seats"]:
            if seq not in seat_of:
                seat = next(i for i in range(len(taken) + 1) if i not in taken)
                seat_of[seq] = seat
                taken.add(seat)
        row = [0] * (max(seat_of.values(), default=-1) + 1)
        for seq, seat in seat_of.items():
            row[seat] = seq
        rows.append(row)
    return rows, max((len(r) for r in rows), default=0)


def _colour(seq_id: int) -> tuple[float, float, float]:
    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    r, g, b, _ = cmap(zlib.crc32(str(seq_id).encode()) % 20 / 19)
    return (r, g, b)


def _seat_image(steps: list[dict[str, Any]]) -> Any:
    import numpy as np

    rows, num_seats = assign_seats(steps)
    image = np.ones((max(num_seats, 1), max(len(steps), 1), 3))
    for x, row in enumerate(rows):
        for seat, seq in enumerate(row):
            if seq:
                image[seat, x] = _colour(seq)
    return image


def _matplotlib() -> Any:
    """matplotlib, or the command's error (exit status 1) saying how to install it."""
    try:
        import matplotlib
    except ImportError as err:
        raise SystemExit(MISSING_MATPLOTLIB) from err
    return matplotlib


def plot(traces: list[Path], out: Path, titles: list[str] | None = None) -> None:
    matplotlib = _matplotlib()

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(traces), figsize=(7 * len(traces), 8), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 1.4]})
    for col, path in enumerate(traces):
        steps = read_trace(path)
        title = titles[col] if titles else path.stem
        _draw_trace(axes[0][col], axes[1][col], steps, title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _draw_trace(top: Any, bottom: Any, steps: list[dict[str, Any]], title: str) -> None:
    image = _seat_image(steps)
    top.imshow(image, aspect="auto", interpolation="nearest", origin="lower")
    busy = sum(len(s["seats"]) for s in steps)
    seats = image.shape[0] * max(len(steps), 1)
    wall = steps[-1]["t"] + steps[-1]["dur"] if steps else 0.0
    top.set_title(f"{title}: {len(steps)} steps, {wall:.1f} s, seats busy {busy / seats:.0%}")
    top.set_xlabel("step")
    top.set_ylabel("seat")
    t = [s["t"] for s in steps]
    bottom.fill_between(t, [s["prefill_tokens"] + s["decode_tokens"] for s in steps], step="post",
                        alpha=0.35, label="tokens (prefill + decode)")
    bottom.fill_between(t, [s["decode_tokens"] for s in steps], step="post", alpha=0.6,
                        label="decode tokens")
    bottom.set_xlabel("time (s)")
    bottom.set_ylabel("tokens / step")
    twin = bottom.twinx()
    twin.step(t, [len(s["seats"]) for s in steps], where="post", color="black", lw=1, label="seats used")
    twin.set_ylabel("seats used")
    bottom.legend(loc="upper right", fontsize=8)
