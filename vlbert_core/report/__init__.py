"""The run report (`results/report/index.html`): tables, loss curves, download accounting, RoIs per
image, per-rule timings and the config, with matplotlib figures. torch-free, like the tables."""

from vlbert_core.report.build import PLOTS, build_report

__all__ = ["PLOTS", "build_report"]
