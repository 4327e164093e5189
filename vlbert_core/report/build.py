"""`results/report/index.html`: one page that shows the tables and how the run went.

The page holds the four tables (from the Markdown twins the tables rule writes, with links to the
CSVs), the pre-training and fine-tuning loss curves, the CC download accounting per shard, the
histogram of RoIs per image, the per-rule timings Snakemake recorded and the config. Figures are PNG
files next to the page, linked by relative paths, so the folder can be copied or served as it is.
"""

from __future__ import annotations

import math
import os
import statistics
from pathlib import Path

import yaml

from vlbert_core.report import plots
from vlbert_core.report.html import esc, html_table, markdown_to_html
from vlbert_core.report.inputs import (
    LossCurves,
    ShardStats,
    finetune_job,
    pretrain_setting,
    read_benchmarks,
    read_loss_curves,
    count_rois,
    read_shard_stats,
    status_order,
    summarise_benchmarks,
)
from vlbert_core.utils import atomic_path, get_logger

log = get_logger(__name__)

# The figures of the page: name (the rule's output name) → (file name, title).
PLOTS = {
    "pretrain_loss": ("pretrain_loss.png", "Pre-training losses per setting"),
    "finetune_loss": ("finetune_loss.png", "Fine-tuning loss per task and schedule"),
    "downloads": ("downloads.png", "Conceptual Captions download accounting per shard"),
    "rois_per_image": ("rois_per_image.png", "RoIs per image"),
    "benchmarks": ("benchmarks.png", "Time and memory per rule"),
}

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 75em; padding: 0 1em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.5em; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
thead th { background: #f0f0f0; }
img { max-width: 100%; border: 1px solid #ddd; }
pre { background: #f7f7f7; padding: 1em; overflow-x: auto; font-size: 0.85em; }
nav li { display: inline; margin-right: 1em; }
figcaption, .small { color: #555; font-size: 0.9em; }
"""


def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _round(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def _link(target: Path, html_dir: Path, text: str | None = None) -> str:
    href = Path(os.path.relpath(target, html_dir)).as_posix()
    return f'<a href="{esc(href)}">{esc(text or target.name)}</a>'


def _figure(name: str, plot_paths: dict[str, Path], html_dir: Path, caption: str) -> str:
    _, title = PLOTS[name]
    src = Path(os.path.relpath(plot_paths[name], html_dir)).as_posix()
    return (f'<figure id="fig-{esc(name)}"><img src="{esc(src)}" alt="{esc(title)}">'
            f"<figcaption>{esc(title)}. {caption}</figcaption></figure>")


def tables_section(tables_md: list[Path], html_dir: Path) -> str:
    parts = ['<section id="tables"><h2>Result tables</h2>',
             ("<p>The paper's numbers (Su et al., ICLR 2020) beside ours. Each measured number comes from one "
              "eval JSON, named in the CSV with its split and example count.</p>")]
    for md in tables_md:
        csv_path = md.with_suffix(".csv")
        if not csv_path.exists():
            raise FileNotFoundError(f"{csv_path}: the CSV twin of {md} is missing")
        parts.append(markdown_to_html(md.read_text(encoding="utf-8")))
        parts.append(f'<p class="small">Files: {_link(csv_path, html_dir)} · {_link(md, html_dir)}</p>')
    parts.append("</section>")
    return "\n".join(parts)


def pretrain_section(curves: list[LossCurves], plot_paths: dict[str, Path], html_dir: Path) -> str:
    plots.plot_pretrain_losses(curves, plot_paths["pretrain_loss"])
    keys = sorted({k for run in curves for k in run.losses}, key=lambda k: (k != "loss", k))
    rows = []
    for run in curves:
        last = {k: next((v for v in reversed(vals) if not math.isnan(v)), None) for k, vals in run.losses.items()}
        rows.append([run.label, len(run.steps)] + [_fmt(last.get(k)) for k in keys]
                    + [run.note or str(run.path)])
    return "\n".join([
        '<section id="pretrain"><h2>Pre-training</h2>',
        _figure("pretrain_loss", plot_paths, html_dir,
                "One panel per Table 4 setting, one line per loss (total and each pre-training task)."),
        "<p>Last value of each loss:</p>",
        html_table(["setting", "steps"] + [f"last {k}" for k in keys] + ["file / note"], rows),
        "</section>",
    ])


def finetune_section(curves: dict[tuple[str, str, str], LossCurves], plot_paths: dict[str, Path],
                     html_dir: Path) -> str:
    plots.plot_finetune_losses(curves, plot_paths["finetune_loss"])
    rows = []
    for (task, setting, schedule), run in curves.items():
        total = run.losses.get("loss", [])
        rows.append([task, setting, schedule, len(run.steps), _fmt(total[0] if total else None),
                     _fmt(total[-1] if total else None), str(run.path)])
    return "\n".join([
        '<section id="finetune"><h2>Fine-tuning</h2>',
        _figure("finetune_loss", plot_paths, html_dir,
                "One panel per task and schedule (full: Tables 1–3, half: Table 4), one line per "
                "pre-training setting."),
        "<details><summary>Every fine-tuning run: steps, first and last total loss</summary>",
        html_table(["task", "setting", "schedule", "steps", "first loss", "last loss", "metrics file"], rows),
        "</details></section>",
    ])


def downloads_section(shards: list[ShardStats], plot_paths: dict[str, Path], html_dir: Path) -> str:
    plots.plot_downloads(shards, plot_paths["downloads"])
    statuses = status_order(shards)
    rows = []
    for shard in shards:
        ok_share = 100.0 * shard.counts.get("ok", 0) / shard.rows_in if shard.rows_in else 0.0
        rows.append([shard.label, shard.rows_in] + [shard.counts.get(s, 0) for s in statuses] + [f"{ok_share:.1f}"])
    total_in = sum(s.rows_in for s in shards)
    totals = [sum(s.counts.get(status, 0) for s in shards) for status in statuses]
    ok_total = 100.0 * totals[0] / total_in if total_in else 0.0
    rows.append(["all shards", total_in] + totals + [f"{ok_total:.1f}"])
    never = sorted({k for s in shards for k, n in s.counts.items()} - set(statuses))
    never_text = f" No row ended in: {', '.join(never)}." if never else ""
    return "\n".join([
        '<section id="downloads"><h2>Download accounting</h2>',
        _figure("downloads", plot_paths, html_dir,
                "Every row of each shard's slice of the CC TSV ends in exactly one status: ok (an image in "
                "the tar) or one failure kind."),
        html_table(["shard", "rows in"] + statuses + ["ok %"], rows),
        f'<p class="small">From {len(shards)} <code>*.stats.json</code> files.{esc(never_text)}</p>',
        "</section>",
    ])


def rois_section(roi_paths: list[Path], plot_paths: dict[str, Path], html_dir: Path,
                 rois_cfg: dict) -> str:
    counts = count_rois(roi_paths)
    plots.plot_rois_per_image(counts, plot_paths["rois_per_image"], rois_cfg.get("min_boxes"),
                              rois_cfg.get("max_boxes"))
    n = counts.num_boxes
    summary = [["images with RoIs", n.size]]
    if n.size:
        summary += [["fewest RoIs", int(n.min())], ["median", _fmt(float(statistics.median(n.tolist())))],
                    ["mean", _fmt(float(n.mean()))], ["most RoIs", int(n.max())]]
    summary += [[f"rows without RoIs: {status}", count] for status, count in counts.not_ok.items()]
    return "\n".join([
        '<section id="rois"><h2>RoIs per image</h2>',
        _figure("rois_per_image", plot_paths, html_dir,
                "Boxes kept per CC image: score above the threshold, at least rois.min_boxes, at most "
                "rois.max_boxes."),
        html_table(["", "value"], summary),
        (f'<p class="small">From {len(roi_paths)} RoI parquet files (<code>status</code> and '
         "<code>num_boxes</code> columns).</p>"),
        "</section>",
    ])


def benchmarks_section(benchmarks_dir: Path, plot_paths: dict[str, Path], html_dir: Path) -> str:
    records = read_benchmarks(benchmarks_dir) if benchmarks_dir.is_dir() else []
    timings = summarise_benchmarks(records)
    plots.plot_benchmarks(timings, plot_paths["benchmarks"])
    rule_rows = [[t.rule, t.jobs, f"{t.total_s:.1f}", f"{t.max_s:.1f}", _round(t.cpu_s), _round(t.peak_rss_mb)] for t in timings]
    job_rows = [[r.rule, r.job or "–", _fmt(r.values["s"]), _fmt(r.values["cpu_time"]), _fmt(r.values["max_rss"]),
                 _fmt(r.values["mean_load"])] for r in sorted(records, key=lambda r: (r.rule, r.job))]
    return "\n".join([
        '<section id="benchmarks"><h2>Timings per rule</h2>',
        _figure("benchmarks", plot_paths, html_dir,
                "Wall seconds summed over each rule's jobs, and the largest resident memory of one job."),
        html_table(["rule (benchmark folder)", "jobs", "wall s (total)", "wall s (longest job)", "CPU s (total)",
                    "peak max_rss MB"], rule_rows),
        "<details><summary>Every job</summary>",
        html_table(["rule", "job", "wall s", "CPU s", "max_rss MB", "mean load"], job_rows),
        "</details>",
        (f'<p class="small">Read at report time from the {len(records)} files under '
         f"<code>{esc(benchmarks_dir)}</code> that Snakemake writes when a job finishes, grouped by the first folder of "
         "their path, which names the rule (jobs of earlier runs in this working directory included; the "
         "report job itself is not among them).</p>"),
        "</section>",
    ])


def config_section(config: dict) -> str:
    text = yaml.safe_dump(config, sort_keys=True, allow_unicode=True, default_flow_style=False)
    return (f'<section id="config"><h2>Config</h2><p>The merged config this run used.</p>'
            f"<pre>{esc(text)}</pre></section>")


def build_report(
    html_path: str | Path,
    plot_paths: dict[str, str | Path],
    *,
    tables_md: list[str | Path],
    pretrain_metrics: list[str | Path],
    finetune_metrics: list[str | Path],
    shard_stats: list[str | Path],
    roi_parquets: list[str | Path],
    benchmarks_dir: str | Path,
    config: dict,
) -> Path:
    """Draw every figure of PLOTS to its path in plot_paths and write the page to html_path."""
    html_path = Path(html_path)
    missing = sorted(set(PLOTS) - set(plot_paths))
    if missing:
        raise ValueError(f"no output path for the figures {missing}")
    plot_paths = {name: Path(p) for name, p in plot_paths.items()}
    html_dir = html_path.parent
    html_dir.mkdir(parents=True, exist_ok=True)

    log.info("reading %d pre-training and %d fine-tuning metrics files", len(pretrain_metrics), len(finetune_metrics))
    pretrain = [read_loss_curves(p, pretrain_setting(p)) for p in pretrain_metrics]
    finetune = {}
    for path in finetune_metrics:
        job = finetune_job(path)
        finetune[job] = read_loss_curves(path, "/".join(job))

    sections = [
        tables_section([Path(p) for p in tables_md], html_dir),
        pretrain_section(pretrain, plot_paths, html_dir),
        finetune_section(finetune, plot_paths, html_dir),
        downloads_section([read_shard_stats(p) for p in shard_stats], plot_paths, html_dir),
        rois_section([Path(p) for p in roi_parquets], plot_paths, html_dir, config.get("rois", {})),
        benchmarks_section(Path(benchmarks_dir), plot_paths, html_dir),
        config_section(config),
    ]
    nav = "".join(f'<li><a href="#{anchor}">{title}</a></li>' for anchor, title in [
        ("tables", "Tables"), ("pretrain", "Pre-training"), ("finetune", "Fine-tuning"),
        ("downloads", "Downloads"), ("rois", "RoIs"), ("benchmarks", "Timings"), ("config", "Config")])
    page = "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        "<title>VL-BERT pipeline report</title>",
        f"<style>{STYLE}</style></head><body>",
        "<h1>VL-BERT pipeline report</h1>",
        (f"<p>Dataset: <strong>{esc(config.get('dataset', '?'))}</strong>, device: "
         f"<strong>{esc(config.get('device', '?'))}</strong>. VL-BERT (Su et al., ICLR 2020) reproduced from raw "
         "data to the paper's tables.</p>"),
        f"<nav><ul>{nav}</ul></nav>",
        *sections,
        "</body></html>",
    ])
    with atomic_path(html_path) as tmp:
        tmp.write_text(page + "\n", encoding="utf-8")
    log.info("wrote %s with %d figures", html_path, len(PLOTS))
    return html_path
