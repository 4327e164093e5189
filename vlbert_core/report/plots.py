"""The report's figures, drawn with matplotlib's Agg backend (no display needed) into PNG files."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: the jobs run without a display

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from vlbert_core.data.status import OK  # noqa: E402
from vlbert_core.report.inputs import LossCurves, RoiCounts, RuleTimings, ShardStats, status_order  # noqa: E402
from vlbert_core.utils import atomic_path  # noqa: E402

DPI = 100


def _save(fig, path: str | Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=DPI)
    plt.close(fig)


def _grid(n: int, ncols: int, width: float = 4.0, height: float = 3.0):
    nrows = max(1, math.ceil(n / ncols))
    ncols = max(1, min(ncols, n))
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False,
                             layout="constrained")
    return fig, axes.ravel()


def _empty_panel(ax, title: str, text: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True, transform=ax.transAxes, fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])


def plot_pretrain_losses(curves: list[LossCurves], path: str | Path) -> None:
    """One panel per pre-training setting, one line per loss (total and each task's)."""
    fig, axes = _grid(len(curves), ncols=3)
    for ax, run in zip(axes, curves):
        title = f"setting {run.label}"
        if not run.steps:
            _empty_panel(ax, title, run.note)
            continue
        for key in sorted(run.losses, key=lambda k: (k != "loss", k)):
            ax.plot(run.steps, run.losses[key], label=key, marker="." if len(run.steps) < 20 else None,
                    linewidth=2.0 if key == "loss" else 1.2)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=7)
    for ax in axes[len(curves):]:
        ax.set_visible(False)
    fig.suptitle("Pre-training losses")
    _save(fig, path)


def plot_finetune_losses(curves: dict[tuple[str, str, str], LossCurves], path: str | Path) -> None:
    """One panel per task × schedule, one line per pre-training setting (total loss)."""
    tasks = list(dict.fromkeys(task for task, _, _ in curves))
    schedules = sorted({schedule for _, _, schedule in curves})  # full (Tables 1-3), then half (Table 4)
    settings = list(dict.fromkeys(setting for _, setting, _ in curves))
    colours = {s: plt.cm.tab10(i % 10) for i, s in enumerate(settings)}
    if not curves:
        fig, ax = plt.subplots(figsize=(5.0, 3.0), layout="constrained")
        _empty_panel(ax, "Fine-tuning loss", "no fine-tuning runs")
        _save(fig, path)
        return
    fig, axes = plt.subplots(len(tasks), len(schedules), figsize=(4.5 * len(schedules), 2.8 * len(tasks)),
                             squeeze=False, layout="constrained")
    for row, task in enumerate(tasks):
        for col, schedule in enumerate(schedules):
            ax = axes[row, col]
            runs = [(s, curves[(task, s, schedule)]) for s in settings if (task, s, schedule) in curves]
            title = f"{task}, schedule {schedule}"
            if not any(run.steps for _, run in runs):
                _empty_panel(ax, title, "no fine-tuning run")
                continue
            for setting, run in runs:
                if not run.steps:
                    continue
                ax.plot(run.steps, run.losses["loss"], label=setting, color=colours[setting])
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.set_ylabel("loss")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.legend(fontsize=7, title="setting", title_fontsize=7)
    fig.suptitle("Fine-tuning loss (total)")
    _save(fig, path)


def plot_downloads(shards: list[ShardStats], path: str | Path) -> None:
    """A stacked bar per CC shard: rows that became images (ok) and each failure kind."""
    statuses = status_order(shards)
    fig, ax = plt.subplots(figsize=(max(6.5, 0.6 * len(shards) + 4), 3.6), layout="constrained")
    x = np.arange(len(shards))
    bottom = np.zeros(len(shards))
    for i, status in enumerate(statuses):
        counts = np.array([shard.counts.get(status, 0) for shard in shards], dtype=float)
        ax.bar(x, counts, bottom=bottom, label=status, color="tab:green" if status == OK else plt.cm.tab10(i % 10))
        bottom += counts
    ax.set_xticks(x, [shard.label for shard in shards], rotation=45 if len(shards) > 6 else 0, ha="right"
                  if len(shards) > 6 else "center")
    ax.set_ylabel("TSV rows")
    ax.set_title("CC download: rows per shard by status")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    _save(fig, path)


def plot_rois_per_image(counts: RoiCounts, path: str | Path, min_boxes: int | None = None,
                        max_boxes: int | None = None) -> None:
    """Histogram of kept RoIs per CC image, with the config's lower and upper limits marked."""
    fig, ax = plt.subplots(figsize=(6.0, 3.6), layout="constrained")
    low, high = (int(counts.num_boxes.min()), int(counts.num_boxes.max())) if counts.num_boxes.size else (0, 1)
    if counts.num_boxes.size:
        ax.hist(counts.num_boxes, bins=np.arange(low, high + 2) - 0.5, color="tab:blue")
    # A limit far from the data (max_boxes=100 when images keep 10-30) would squash the bars: it is
    # drawn only near the data, and the title always gives both.
    for limit, name in ((min_boxes, "rois.min_boxes"), (max_boxes, "rois.max_boxes")):
        if limit is not None and low - 5 <= limit <= high + 5:
            ax.axvline(limit, color="tab:red", linestyle="--", linewidth=1)
            ax.text(limit, 1.0, f" {name}={limit}", color="tab:red", fontsize=8, va="top",
                    transform=ax.get_xaxis_transform())
    pad = max(2, (high - low) // 10)  # room for a few integer ticks even when every image has the same count
    ax.set_xlim(low - 0.5 - pad, high + 0.5 + pad)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("RoIs kept per image")
    ax.set_ylabel("images")
    limits = f", limits {min_boxes}–{max_boxes}" if min_boxes is not None and max_boxes is not None else ""
    ax.set_title(f"RoIs per image ({counts.num_boxes.size} CC images{limits})")
    _save(fig, path)


def plot_benchmarks(timings: list[RuleTimings], path: str | Path) -> None:
    """Per rule: wall seconds summed over its jobs, and the peak resident memory of one job."""
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(10.0, max(2.5, 0.4 * len(timings) + 1.2)),
                                          layout="constrained")
    if not timings:
        _empty_panel(ax_time, "Time per rule", "no benchmark files yet")
        _empty_panel(ax_mem, "Peak memory per rule", "no benchmark files yet")
        _save(fig, path)
        return
    rules = [t.rule for t in timings]
    y = np.arange(len(rules))
    ax_time.barh(y, [t.total_s for t in timings], color="tab:blue")
    ax_time.set_yticks(y, [f"{t.rule} ({t.jobs})" for t in timings])
    ax_time.invert_yaxis()
    ax_time.set_xlabel("wall seconds, all jobs of the rule")
    ax_time.set_title("Time per rule (job count)")
    ax_mem.barh(y, [t.peak_rss_mb or 0.0 for t in timings], color="tab:orange")
    ax_mem.set_yticks(y, rules)
    ax_mem.invert_yaxis()
    ax_mem.set_xlabel("MB, largest max_rss of one job")
    ax_mem.set_title("Peak memory per rule")
    _save(fig, path)
