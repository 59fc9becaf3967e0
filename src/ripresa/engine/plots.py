"""Pictures and comparisons of a run's history: ``ripresa plot`` and ``ripresa compare`` (docs/ENGINE.md).

:func:`plot_run` draws one PNG of a run: the loss of every step (light) and its EMA (bold), checkpoint marks,
labelled resume / signal / pivot / fork / zombie-arm marks, and the rolling share of each data-mixture arm;
:func:`compare_runs` compares runs forked from one step (docs/ENGINE.md, "Pivot and fork"), overlaying their EMA
curves; :func:`render_comparison` prints its table. The history is read by :mod:`ripresa.engine.run_history`.
matplotlib (the ``engine`` extra) is imported only when a picture is drawn, through its Agg canvas only.
"""

from __future__ import annotations

import bisect
import io
import math
from array import array
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ..errors import BadInput, MissingDependency
from ..io.fsio import write_atomic
from .run_history import EMA_ALPHA, Event, ema_array, ema_series, load_run, rolling_arm_shares

#: Event kinds drawn as labelled marks, with (colour, line style, line width).
EVENT_STYLE: dict[str, tuple[str, str, float]] = {
    "resume": ("#2ca02c", "--", 1.6),
    "signal": ("#ff7f0e", "-.", 1.6),
    "pivot": ("#9467bd", "-", 2.2),
    "fork": ("#8c564b", "-", 2.0),
    "zombie_arm": ("#e377c2", ":", 2.0),
    "bandit_fresh": ("#bcbd22", ":", 1.6),
    "checkpoint_failed": ("#d62728", "--", 1.6),
}
MARKED_EVENTS = tuple(EVENT_STYLE)
CHECKPOINT_COLOUR = "#b5b5b5"
RAW_COLOUR = "#9ecae1"
EMA_COLOUR = "#08519c"
RUN_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf", "#e377c2")
ARM_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
               "#9c755f", "#bab0ac")
MAX_LABELS_PER_KIND = 8  # beyond this a kind is drawn as marks and counted in the legend only
DENSE_CHECKPOINTS = 80  # beyond this checkpoints are short ticks at the bottom, not full-height lines
FIG_SIZE = (12.0, 7.2)
DPI = 100

#: What the last :func:`plot_run` drew (for tests and for the CLI's summary line).
last_plot_info: dict[str, Any] = {}
#: Most points drawn per curve: a longer run is drawn every k-th step (the numbers use every step).
MAX_DRAWN_POINTS = 20_000


def _drawn(n: int) -> tuple[int, list[int]]:
    """(stride, indices) of the points drawn of a curve of ``n``: every stride-th and the last."""
    stride = max(1, -(-n // MAX_DRAWN_POINTS))
    idx = list(range(0, n, stride))
    if n and idx[-1] != n - 1:
        idx.append(n - 1)
    return stride, idx


def _finite(xs: Iterable[float]) -> list[float]:
    return [x for x in xs if isinstance(x, float) and math.isfinite(x)]


def _json_float(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


# ---- drawing helpers ------------------------------------------------------------------------------


def _matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:  # tests/test_api.py hides matplotlib to check this
        raise MissingDependency("drawing a plot needs matplotlib", expected="matplotlib >= 3.8", found="not installed",
                                hint="pip install 'ripresa[engine]'") from exc
    return Figure, FigureCanvasAgg


def _save_png(fig: Any, canvas_cls: Any, out: Path) -> Path:
    out = Path(out)
    if not out.parent.is_dir():
        raise BadInput("cannot write the PNG: its folder does not exist", file=out, expected="an existing folder",
                       found="nothing", hint="create the folder first or choose another --png")
    canvas_cls(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, facecolor="white", pil_kwargs={"optimize": True})
    write_atomic(out, [buf.getvalue()])
    return out


def _loss_limits(values: Sequence[float], ema: Sequence[float], headroom: float) -> tuple[float, float] | None:
    import numpy as np

    v = np.asarray(values, dtype=np.float64)
    raw = np.sort(v[np.isfinite(v)])
    if not len(raw):
        return None
    e = np.asarray(ema, dtype=np.float64)
    e = e[np.isfinite(e)]
    lo = float(min(raw[0], e.min() if len(e) else raw[0]))
    # A few wild steps (a spike, a diverged arm) must not flatten the whole curve.
    hi = float(max(raw[min(len(raw) - 1, int(0.995 * (len(raw) - 1)))], e.max() if len(e) else raw[-1]))
    span = (hi - lo) or max(abs(hi), 1.0) * 0.1
    return lo - 0.04 * span, hi + (0.04 + headroom) * span


def _event_label(ev: Event) -> str:
    r = ev.record
    if ev.kind == "resume":
        redo = f", {ev.redone} steps redone" if ev.redone else ""
        return f"resume ← {ev.step}" + (" (foreign)" if r.get("foreign") else "") + redo
    if ev.kind == "signal":
        sigs = r.get("signals") or []
        name = "+".join(str(s) for s in sigs) if isinstance(sigs, list) and sigs else "signal"
        action = r.get("action")
        return f"{name} @{ev.step}" + (f" → {action}" if action else "")
    if ev.kind == "pivot":
        return f"pivot @{ev.step}"
    if ev.kind == "fork":
        return f"fork of {ev.step}"
    if ev.kind == "zombie_arm":
        return f"zombie arm {r.get('arm', '?')}"
    if ev.kind == "bandit_fresh":
        return "fresh bandit"
    if ev.kind == "checkpoint_failed":
        return f"checkpoint failed @{ev.step}"
    return ev.kind


def _place_labels(items: list[tuple[float, str]], x0: float, x1: float, tiers: int) -> list[tuple[int, bool] | None]:
    """A (tier, to-the-left) per label so that labels do not overlap, or None where none fits.

    Widths are estimated (8-point bold text on a ~900-pixel-wide panel); a label
    that would run past the right edge is written to the left of its mark.
    """
    span = (x1 - x0) or 1.0
    taken: list[list[tuple[float, float]]] = [[] for _ in range(tiers)]
    out: list[tuple[int, bool] | None] = []
    for x, text in items:
        at = (x - x0) / span
        width = 0.0075 * (len(text) + 1) + 0.004
        sides = [s for s in (False, True) if (at - width >= 0.0 if s else at + width <= 1.0)] or [at + width > 1.0]
        spot = None
        for tier in range(tiers):
            for left_side in sides:
                lo, hi = (at - width, at) if left_side else (at, at + width)
                if all(hi <= a or lo >= b for a, b in taken[tier]):
                    spot = (tier, left_side, lo, hi)
                    break
            if spot:
                break
        if spot is None:
            out.append(None)
            continue
        taken[spot[0]].append((spot[2], spot[3]))
        out.append((spot[0], spot[1]))
    return out


def ema_alpha_for(n_steps: int) -> float:
    """The EMA of ``ripresa plot``: :data:`EMA_ALPHA` (~50 steps), longer for long runs (~n/200 steps)."""
    return max(EMA_ALPHA, 1.0 - 1.0 / max(50.0, n_steps / 200.0))


# ---- ripresa plot ---------------------------------------------------------------------------------


def plot_run(run_dir: Path, png: Path | None = None) -> Path:
    """Draw one run's history to ``png`` (default ``RUN/plot.png``); return the path.

    Top panel: loss per step (light), its EMA (bold), thin grey marks at
    checkpoints, coloured labelled marks at resume / signal / pivot / fork /
    zombie-arm / failed-checkpoint / fresh-bandit events. Bottom panel: rolling
    share of each data-mixture arm (from each step's ``arm``). What was drawn is
    left in :data:`last_plot_info`.
    """
    run = load_run(run_dir)
    out = Path(png) if png is not None else run.folder / "plot.png"
    Figure, Canvas = _matplotlib()

    import numpy as np

    alpha = ema_alpha_for(len(run.steps))
    full_ema = ema_array(run.losses, alpha)
    first, last = run.steps[0], run.steps[-1]
    n_steps = len(run.steps)
    last_loss = next((x for x in reversed(run.losses) if math.isfinite(x)), math.nan)
    last_ema = next((x for x in reversed(full_ema) if math.isfinite(x)), math.nan)
    limits_all = _loss_limits(run.losses, full_ema, headroom=0.0)
    stride, drawn_idx = _drawn(n_steps)  # a long run is drawn every stride-th step; the numbers use every step
    steps = [run.steps[i] for i in drawn_idx]
    losses = [run.losses[i] for i in drawn_idx]
    ema = [full_ema[i] for i in drawn_idx]
    del full_ema
    marked = [e for e in run.events if e.kind in EVENT_STYLE]
    checkpoints = [int(x) for x in np.unique(np.frombuffer(run.checkpoint_steps, dtype=np.int64))] \
        if isinstance(run.checkpoint_steps, array) and len(run.checkpoint_steps) else sorted(set(run.checkpoint_steps))

    fig = Figure(figsize=FIG_SIZE, dpi=DPI, layout="constrained")
    grid = fig.add_gridspec(2, 1, height_ratios=(3.0, 1.35))
    ax = fig.add_subplot(grid[0])
    ax_arm = fig.add_subplot(grid[1], sharex=ax)

    # Loss and EMA.
    ax.plot(steps, losses, color=RAW_COLOUR, lw=0.9, label="loss (per step)", zorder=2)
    ax.plot(steps, ema, color=EMA_COLOUR, lw=2.4, label=f"EMA (α={alpha:g})", zorder=3)
    tiers = 4
    if limits_all:
        span_lo, span_hi = limits_all
        span = span_hi - span_lo
        ax.set_ylim(span_lo, span_hi + (0.06 * tiers if marked else 0.0) * span / 1.08)
    pad = max(1, round((last - first) * 0.01))
    ax.set_xlim(min(first, *(e.step for e in marked)) - pad if marked else first - pad, last + pad)
    x0, x1 = ax.get_xlim()

    # Checkpoints: thin marks, one legend entry.
    if len(checkpoints) > DENSE_CHECKPOINTS:  # full-height lines would grey out the panel
        ax.vlines(checkpoints, 0, 0.03, transform=ax.get_xaxis_transform(), colors=CHECKPOINT_COLOUR, lw=0.5,
                  zorder=1, label=f"checkpoint ({len(checkpoints)}, ticks)")
    elif checkpoints:
        ax.vlines(checkpoints, 0, 1, transform=ax.get_xaxis_transform(), colors=CHECKPOINT_COLOUR, lw=0.7,
                  zorder=1, label=f"checkpoint ({len(checkpoints)})")
    # Events: coloured marks on both panels, labels on the loss panel.
    drawn: dict[str, int] = {}
    labels: list[str] = []
    label_items: list[tuple[Event, str]] = []
    for kind, (colour, style, width) in EVENT_STYLE.items():
        evs = [e for e in marked if e.kind == kind]
        if not evs:
            continue
        xs = [e.step for e in evs]
        drawn[kind] = run.event_counts.get(kind, len(evs))
        for axis, lab in ((ax, f"{kind.replace('_', ' ')} ({drawn[kind]})"), (ax_arm, None)):
            axis.vlines(xs, 0, 1, transform=axis.get_xaxis_transform(), colors=colour, linestyles=style,
                        lw=width, zorder=4, label=lab)
        redone = [e for e in evs if e.redone]  # steps a crash cost: logged by the dead process, run again
        for i, e in enumerate(redone):
            ax.axvspan(e.step, e.logged_before, color=colour, alpha=0.08, lw=0, zorder=0,
                       label=f"steps redone after a crash ({sum(r.redone for r in redone)})" if i == 0 else None)
        if len(evs) <= MAX_LABELS_PER_KIND:
            label_items += [(e, _event_label(e)) for e in evs]
    label_items.sort(key=lambda it: it[0].step)
    placed = _place_labels([(e.step, t) for e, t in label_items], x0, x1, tiers)
    for (ev, text), where in zip(label_items, placed, strict=True):
        if where is None:
            continue  # no room: the mark and the legend's count still show it
        tier, to_left = where
        ax.annotate(text, xy=(ev.step, 1.0), xycoords=ax.get_xaxis_transform(),
                    xytext=(-3 if to_left else 3, -4 - 13 * tier), textcoords="offset points",
                    ha="right" if to_left else "left", va="top", fontsize=8, color=EVENT_STYLE[ev.kind][0],
                    fontweight="bold", zorder=5,
                    bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8})
        labels.append(text)
    ax.set_ylabel("loss")
    ax.grid(True, axis="y", color="#e6e6e6", lw=0.6)
    ax.tick_params(labelbottom=False)
    ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8.5, frameon=False)

    # Arm shares.
    window = max(5, min(200, n_steps // 15))
    have_arms = any(a is not None for a in run.arms)
    arm_names: list[str] = []
    if have_arms:
        shares = rolling_arm_shares(run.arms, window, stride)
        arm_names = list(shares)
        colours = [ARM_COLOURS[i % len(ARM_COLOURS)] for i in range(len(arm_names))]
        ax_arm.stackplot(steps, [shares[a] for a in arm_names], labels=arm_names, colors=colours, alpha=0.9,
                         lw=0, zorder=2)
        ax_arm.set_ylim(0, 1)
        ax_arm.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8.5, frameon=False,
                      title="arm", title_fontsize=8.5)
    else:
        ax_arm.text(0.5, 0.5, "no 'arm' field in this history", transform=ax_arm.transAxes, ha="center",
                    va="center", color="#777777")
        ax_arm.set_ylim(0, 1)
    ax_arm.set_ylabel(f"arm share\n(last {window} steps)")
    ax_arm.set_xlabel("step")

    what = f" ({run.config_name})" if run.config_name else ""
    fig.suptitle(f"{run.name}{what} — steps {first}–{last} ({n_steps} logged) · last loss {last_loss:.4f}"
                 f" · EMA {last_ema:.4f}", fontsize=13, fontweight="bold")
    _save_png(fig, Canvas, out)

    last_plot_info.clear()
    last_plot_info.update({
        "path": str(out), "run": run.name, "steps": n_steps, "first_step": first, "last_step": last,
        "events": {"checkpoint": len(checkpoints), **{k: drawn.get(k, 0) for k in MARKED_EVENTS}},
        "labels": labels, "redone": sum(e.redone for e in run.of_kind("resume")), "arms": arm_names, "arm_window": window,
        "last_loss": _json_float(last_loss), "last_ema": _json_float(last_ema), "ema_alpha": alpha,
        "skipped_lines": run.skipped_lines, "drawn_points": len(steps),
    })
    return out


# ---- ripresa compare ------------------------------------------------------------------------------


#: ``compare`` names a winner only when the EMA gap is at least this many times the EMAs' noise.
CONFIDENT_GAP = 2.0


def noise_window(alpha: float) -> int:
    """Steps over which ``compare`` measures the loss's spread: the EMA's memory, ``1/(1-alpha)``, at least 10."""
    return max(10, round(1.0 / (1.0 - alpha)))


def _ema_noise(losses: Any, alpha: float, window: int) -> float | None:
    """The standard deviation of an EMA's value due to the step-to-step noise of the loss.

    The spread of the raw loss over the last ``window`` finite steps, around
    a straight line fitted to them (the trend is not noise), scaled by
    ``sqrt((1 - alpha) / (1 + alpha))`` — the standard deviation of an EMA of
    independent noise of unit spread. ``None`` with fewer than 3 steps.
    """
    import numpy as np

    tail = losses[-window:]
    tail = tail[np.isfinite(tail)]
    if len(tail) < 3:
        return None
    x = np.arange(len(tail), dtype=np.float64)
    slope, icept = np.polyfit(x, tail, 1)
    resid = tail - (slope * x + icept)
    spread = float(np.sqrt(np.sum(resid * resid) / (len(tail) - 2)))
    return spread * math.sqrt((1.0 - alpha) / (1.0 + alpha))


def compare_runs(runs: Sequence[Path], png: Path | None = None, *, ema: float = EMA_ALPHA) -> dict:
    """Compare runs from their fork point; say which converges lower.

    The comparison starts at ``from_step``: the largest ``parent_step`` of the
    runs' ``fork`` events, or, without a fork, the largest first step. The
    runs' EMAs start there, and they are compared at the last step every run
    has logged (``last_common_step``). Per run: ``final_loss`` (raw loss at
    that step), ``ema_loss`` (EMA there), ``best_loss``/``best_step`` (lowest
    loss in the compared range), ``steps`` compared, the run's own
    ``last_step`` and ``last_loss``, ``ema_noise`` (:func:`_ema_noise`).
    ``winner``: the run with the lowest finite EMA (``None`` when none is
    finite). How sure that is: ``noise`` (the two lowest EMAs' noises
    combined), ``gap_over_noise`` (``margin / noise``) and ``within_noise``
    (the gap is under :data:`CONFIDENT_GAP` times the noise: the verdict does
    not name a winner). The noise is that of one run per side; the spread
    between seeds is not measured. JSON-able.
    """
    if len(runs) < 2:
        raise BadInput("compare needs at least two runs", expected="RUN_A RUN_B [...]", found=[str(r) for r in runs])
    ema_series([], ema)  # validates alpha before any work
    loaded = [load_run(r) for r in runs]
    names = [r.name for r in loaded]
    if len(set(names)) < len(names):
        names = [str(r.folder) for r in loaded]
    forks = [r.fork_step() for r in loaded]
    starts = [f if f is not None else r.steps[0] for r, f in zip(loaded, forks, strict=True)]
    from_step = max(starts)
    import numpy as np

    common_arr: Any = None
    for r in loaded:
        mine = np.frombuffer(r.steps, dtype=np.int64) if isinstance(r.steps, array) else np.asarray(r.steps, np.int64)
        mine = mine[mine >= from_step]
        common_arr = mine if common_arr is None else np.intersect1d(common_arr, mine, assume_unique=True)
    n_common = int(len(common_arr))
    if not n_common:
        raise BadInput("the runs have no steps in common", expected=f"steps logged by every run from step {from_step}",
                       found="; ".join(f"{n}: {r.steps[0]}–{r.steps[-1]}" for n, r in zip(names, loaded, strict=True)),
                       hint="compare runs forked from the same checkpoint, or runs that cover the same steps")
    last_common = int(common_arr[-1])
    del common_arr

    rows: list[dict[str, Any]] = []
    curves: list[tuple[list[int], list[float], list[float]]] = []
    window = noise_window(ema)
    for name, r, fork in zip(names, loaded, forks, strict=True):
        i0 = bisect.bisect_left(r.steps, from_step)  # steps are sorted, one per step
        st, ls = r.steps[i0:], r.losses[i0:]
        em = ema_array(ls, ema)
        at = bisect.bisect_left(st, last_common)
        upto = np.asarray(ls[: at + 1], dtype=np.float64)
        finite = np.isfinite(upto)
        if finite.any():
            j = int(np.argmin(np.where(finite, upto, np.inf)))  # the first lowest, as min() would
            best_step, best = int(st[j]), float(upto[j])
        else:
            best_step, best = None, math.nan
        last_loss = next((x for x in reversed(ls) if math.isfinite(x)), math.nan)
        rows.append({
            "run": name, "path": str(r.folder), "fork_step": fork, "first_step": st[0], "last_step": st[-1],
            "steps": at + 1, "final_loss": _json_float(ls[at]), "ema_loss": _json_float(em[at]),
            "best_loss": _json_float(best), "best_step": best_step, "last_loss": _json_float(last_loss),
            "non_finite_steps": int((~finite).sum()),
        })
        _, idx = _drawn(len(st))  # drawn every k-th step at most MAX_DRAWN_POINTS per curve
        curves.append(([st[i] for i in idx], [ls[i] for i in idx], [em[i] for i in idx]))
        row = rows[-1]
        row["ema_noise"] = _json_float(_ema_noise(np.asarray(ls[: at + 1], dtype=np.float64), ema, window))
    ranked = sorted((row for row in rows if row["ema_loss"] is not None), key=lambda row: row["ema_loss"])
    margin = ranked[1]["ema_loss"] - ranked[0]["ema_loss"] if len(ranked) > 1 else None
    tie = margin == 0.0  # identical EMAs: neither converges lower
    winner = ranked[0]["run"] if ranked and not tie else None
    for row in rows:
        row["winner"] = row["run"] == winner
        row["ema_gap"] = (row["ema_loss"] - ranked[0]["ema_loss"]) if ranked and row["ema_loss"] is not None else None
    # How sure: the gap between the two lowest EMAs against the noise of those two EMAs (docs/ENGINE.md, "compare").
    noises = [row["ema_noise"] for row in ranked[:2]]
    noise = math.sqrt(sum(x * x for x in noises)) if len(noises) == 2 and None not in noises else None
    ratio = (margin / noise if noise else math.inf) if margin is not None and noise is not None else None
    result: dict[str, Any] = {
        "runs": rows, "winner": winner, "tie": tie, "margin": margin, "from_step": from_step,
        "forked": any(f is not None for f in forks), "last_common_step": last_common, "common_steps": n_common,
        "ema_alpha": float(ema), "png": None,
        "noise": _json_float(noise) if noise is not None else None, "noise_window": window,
        "gap_over_noise": _json_float(ratio) if ratio is not None and math.isfinite(ratio) else None,
        "within_noise": None if ratio is None or tie else bool(ratio < CONFIDENT_GAP),
    }
    if png is not None:
        result["png"] = str(_draw_comparison(result, curves, Path(png)))
    return result


def _draw_comparison(result: dict[str, Any], curves: list[tuple[list[int], list[float], list[float]]],
                     out: Path) -> Path:
    Figure, Canvas = _matplotlib()
    fig = Figure(figsize=(12.0, 6.4), dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    from_step, last_common = result["from_step"], result["last_common_step"]
    all_raw: list[float] = []
    all_ema: list[float] = []
    for i, (row, (st, ls, em)) in enumerate(zip(result["runs"], curves, strict=True)):
        colour = RUN_COLOURS[i % len(RUN_COLOURS)]
        ax.plot(st, ls, color=colour, lw=0.8, alpha=0.22, zorder=2)
        ema_txt = f"{row['ema_loss']:.4f}" if row["ema_loss"] is not None else "n/a"
        tag = "  ◀ lower" if row["winner"] and not result.get("within_noise") else ""
        ax.plot(st, em, color=colour, lw=2.4, zorder=3, label=f"{row['run']}: EMA {ema_txt}{tag}")
        all_raw += ls
        all_ema += em
    limits = _loss_limits(all_raw, all_ema, headroom=0.05)
    if limits:
        ax.set_ylim(*limits)
    what = f"fork @{from_step}" if result["forked"] else f"from {from_step}"
    ax.axvline(from_step, color="#555555", lw=1.2, ls="--", zorder=1, label=what)
    ax.axvline(last_common, color="#999999", lw=1.0, ls=":", zorder=1, label=f"last common step {last_common}")
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss (EMA α={result['ema_alpha']}, raw faint)")
    ax.grid(True, color="#ececec", lw=0.6)
    ax.legend(loc="upper right", fontsize=9.5, framealpha=0.9)
    names = " vs ".join(row["run"] for row in result["runs"])
    verdict = ("within noise" if result.get("within_noise")
               else f"{result['winner']} converges lower" if result["winner"] is not None
               else "a tie" if result.get("tie") else "no finite EMA to compare")
    fig.suptitle(f"{names} — {what}, EMA at step {last_common}: {verdict}", fontsize=13, fontweight="bold")
    return _save_png(fig, Canvas, out)


def render_comparison(result: dict[str, Any], console: Any) -> None:
    """Print :func:`compare_runs`'s result as a table and a one-line verdict (how sure, before a winner)."""
    from ..console import fit_table
    from ..text import escape_markup

    def num(x: float | None) -> str:
        return "—" if x is None else f"{x:.4f}"

    forked = result.get("forked")
    title = (f"compare from {'fork at ' if forked else ''}step {result['from_step']} "
             f"to last common step {result['last_common_step']} (EMA α={result['ema_alpha']})")
    rows = []
    for row in result["runs"]:
        gap = row.get("ema_gap")
        best = f"{num(row['best_loss'])} ({row['best_step']})" if row["best_step"] is not None else "—"
        winner = row.get("winner") and not result.get("within_noise")
        name = f"[bold green]{escape_markup(row['run'])} ★[/]" if winner else escape_markup(row["run"])
        rows.append([name, str(row["steps"]), f"{row['first_step']}–{row['last_step']}", num(row["final_loss"]),
                     num(row["ema_loss"]), "—" if gap is None else f"+{gap:.4f}", best, num(row["last_loss"])])
    header = ("run", "steps", "range", "final loss", "EMA loss", "Δ EMA", "best loss (step)", "last loss")
    console.print(fit_table(title, header, rows, console.width))  # across when it fits, else down: numbers whole
    if result.get("tie"):
        console.print(f"[yellow]a tie: the runs have the same EMA loss at step {result['last_common_step']}[/]")
    elif result["winner"] is None:
        console.print("[yellow]no run has a finite EMA loss: nothing converges[/]")
    else:
        margin, noise = result.get("margin"), result.get("noise")
        window = min(result.get("noise_window") or 0, min(row["steps"] for row in result["runs"]))
        if margin is None:
            console.print(f"[bold]{result['winner']}[/] is the only run with a finite EMA loss")
        elif result.get("within_noise") is None:
            console.print(f"[bold]{result['winner']}[/] has the lower EMA at step {result['last_common_step']} "
                          f"(by {margin:.4f}); too few steps to measure the noise: no confidence given")
        elif result["within_noise"]:
            console.print(f"[yellow]within noise:[/] {escape_markup(result['winner'])}'s EMA at step "
                          f"{result['last_common_step']} is lower by {margin:.4f}, but the EMAs' noise is ±{noise:.4f} "
                          f"(the loss's spread over the last {window} steps): a gap under {CONFIDENT_GAP:g}× the "
                          "noise names no winner. Train longer, or repeat each side with other seeds "
                          "(--set train.seed=N) and compare again")
        else:
            ratio = result.get("gap_over_noise")
            times = f"{ratio:.1f}× " if ratio is not None else "far above "
            console.print(f"[bold]{escape_markup(result['winner'])}[/] converges lower (EMA at step "
                          f"{result['last_common_step']} by {margin:.4f}, {times}the EMAs' noise ±{noise:.4f} over the "
                          f"last {window} steps; one run per side: the spread between seeds is not measured)")
    if result.get("png"):
        console.print(f"plot: {result['png']}")
