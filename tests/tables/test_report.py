"""The run report from fixture files: the page parses, every image it shows exists, nothing is lost."""

import json
import math
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vlbert_core.report import PLOTS, build_report
from vlbert_core.rois import STATUS_OK, RoIParquetWriter
from vlbert_core.report.inputs import (
    read_benchmarks,
    read_loss_curves,
    count_rois,
    read_shard_stats,
    summarise_benchmarks,
)

CONFIG = {
    "dataset": "synthetic",
    "device": "cpu",
    "rois": {"min_boxes": 10, "max_boxes": 100},
    "finetune": {"vqa": {"lr": 0.000123, "optimizer": "adamw"}},
    "sources": {"note": "<b>escaped</b>"},
}
BENCHMARK_HEADER = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def pretrain_rows(steps: int, rel: bool = False) -> list[dict]:
    rows = []
    for step in range(1, steps + 1):
        row = {"step": step, "lr": 1e-4, "loss": 20.0 / step, "mlm_loss": 10.0 / step, "roi_loss": 2.0 / step,
               "mlm_acc": None}
        if rel:
            row["rel_loss"] = 0.7
        rows.append(row)
    return rows


def write_benchmark(path: Path, *lines: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(BENCHMARK_HEADER + "".join(line + "\n" for line in lines))


def write_rois(path: Path, statuses: list[str], num_boxes: list[int]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with RoIParquetWriter(path, num_classes=2, metadata={"source": "test"}) as writer:
        for i, (status, n) in enumerate(zip(statuses, num_boxes)):
            if status != STATUS_OK:
                writer.add_failure(f"k{i}", status, "unreadable")
                continue
            writer.add(f"k{i}", image_w=8, image_h=6, boxes=np.zeros((n, 4), np.float32), scores=np.ones(n, np.float32),
                       class_ids=np.ones(n, np.int32), class_scores=np.full((n, 2), 0.5, np.float32))
    return path


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A working directory with what the report rule reads, as the workflow lays it out."""
    root = tmp_path_factory.mktemp("report_run")
    tables = root / "results" / "tables"
    tables.mkdir(parents=True)
    for name, number in [("table1_vcr", "73.8"), ("table4_ablation", "72.9 / 31.4")]:
        (tables / f"{name}.md").write_text(
            f"# Title of {name}\n\n| source | model | value |\n|---|---|---|\n| reported | VL-BERT BASE | {number} |\n\n"
            "Measured rows ran on the **synthetic** data (schedule `half`).\n- a note\n")
        (tables / f"{name}.csv").write_text("source,model,value\nreported,VL-BERT BASE,73.8\n")
    write_jsonl(root / "results/pretrain/none/metrics.jsonl",
                [{"note": "not pre-trained: the BERT-initialised model", "samples": 0, "setting": "none",
                  "step": 0, "steps": 0}])
    write_jsonl(root / "results/pretrain/a/metrics.jsonl", pretrain_rows(5))
    write_jsonl(root / "results/pretrain/c/metrics.jsonl", pretrain_rows(5, rel=True))
    for task, setting, schedule in [("vqa", "none", "full"), ("vqa", "a", "half"), ("refcoco", "a", "half")]:
        write_jsonl(root / f"results/finetune/{task}/{setting}/{schedule}/metrics.jsonl",
                    [{"step": s, "epoch": 0, "loss": 5.0 / s, "lr": 1e-4, "elapsed_s": s} for s in range(1, 7)])
    shards = root / "results/shards/cc"
    shards.mkdir(parents=True)
    for shard, (ok, missing) in enumerate([(90, 6), (93, 3)]):
        (shards / f"train-{shard:05d}.stats.json").write_text(json.dumps({
            "counts": {"ok": ok, "not_found": missing, "timeout": 0}, "rows_in": ok + missing, "ok": ok,
            "failed": missing, "split": "train", "shard": shard}))
    write_rois(root / "results/rois/cc/train-00000.parquet", ["ok", "ok", "ok", "decode_error"], [10, 12, 12, 0])
    write_rois(root / "results/rois/cc/train-00001.parquet", ["ok", "ok"], [30, 10])
    bench = root / "benchmarks/rules"
    write_benchmark(bench / "world.tsv", "12.5\t0:00:12\t300.0\t900.0\t280.0\t290.0\t1.0\t50.0\t80.0\t10.0")
    write_benchmark(bench / "pretrain/a.tsv", "100.0\t0:01:40\t2000.0\t5000.0\t1900.0\t1950.0\t5.0\t9.0\t95.0\t99.0")
    write_benchmark(bench / "pretrain/c.tsv", "50.0\t0:00:50\t2500.0\t5000.0\t1900.0\t1950.0\t5.0\t9.0\t95.0\t49.0")
    write_benchmark(bench / "evaluate/vqa/a/half/val.tsv", "0.8\t0:00:00\t37.5\tNA\tNA\tNA\t0.0\t0.0\t0.0\t0.4")
    return root


@pytest.fixture(scope="module")
def report(workdir) -> Path:
    out = workdir / "results" / "report"
    results = workdir / "results"
    return build_report(
        out / "index.html",
        {name: out / filename for name, (filename, _) in PLOTS.items()},
        tables_md=[results / "tables/table1_vcr.md", results / "tables/table4_ablation.md"],
        pretrain_metrics=[results / f"pretrain/{s}/metrics.jsonl" for s in ["none", "a", "c"]],
        finetune_metrics=sorted(results.glob("finetune/*/*/*/metrics.jsonl")),
        shard_stats=sorted(results.glob("shards/cc/*.stats.json")),
        roi_parquets=sorted(results.glob("rois/cc/*.parquet")),
        benchmarks_dir=workdir / "benchmarks/rules",
        config=CONFIG,
    )


class PageParser(HTMLParser):
    """Collects image sources, links, table cells and the text; checks that tags are balanced."""

    VOID = frozenset({"meta", "img", "br", "hr", "link", "input"})

    def __init__(self):
        super().__init__()
        self.stack, self.images, self.links, self.cells, self.text = [], [], [], [], []
        self._in_cell = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs)
        if tag == "a" and "href" in attrs:
            self.links.append(attrs["href"])
        if tag not in self.VOID:
            self.stack.append(tag)
        if tag == "td":
            self._in_cell = True
            self.cells.append("")

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1] if self.stack else None}>"
        self.stack.pop()
        if tag == "td":
            self._in_cell = False

    def handle_data(self, data):
        self.text.append(data)
        if self._in_cell:
            self.cells[-1] += data


@pytest.fixture(scope="module")
def page(report) -> PageParser:
    parser = PageParser()
    parser.feed(report.read_text(encoding="utf-8"))
    parser.close()
    assert parser.stack == [], f"unclosed tags: {parser.stack}"
    return parser


@pytest.mark.slow
def test_every_image_the_page_references_exists_and_is_a_png(report, page):
    assert page.images, "the page shows no image"
    for img in page.images:
        src = img["src"]
        assert not Path(src).is_absolute() and "/" not in src, f"{src}: figures sit next to index.html"
        path = report.parent / src
        assert path.read_bytes()[:8] == PNG_MAGIC, f"{path} is not a PNG"
        assert img.get("alt"), f"{src} has no alt text"


def test_each_listed_plot_is_on_the_page(page):
    shown = [img["src"] for img in page.images]
    assert sorted(shown) == sorted(filename for filename, _ in PLOTS.values())


def test_relative_links_point_at_existing_files(report, page):
    files = [href for href in page.links if not href.startswith("#")]
    assert "../tables/table1_vcr.csv" in files and "../tables/table4_ablation.md" in files
    for href in files:
        assert (report.parent / href).exists(), href


def test_the_tables_are_on_the_page(page):
    assert "72.9 / 31.4" in page.cells
    assert "Title of table1_vcr" in "".join(page.text)


def test_the_config_appears_escaped(report, page):
    text = "".join(page.text)
    assert "lr: 0.000123" in text and "optimizer: adamw" in text
    assert "note: <b>escaped</b>" in text  # the text as data ...
    assert "&lt;b&gt;escaped" in report.read_text(encoding="utf-8")  # ... never as markup


def test_download_accounting_per_shard_and_in_total(page):
    cells = page.cells
    row = cells.index("train-00000")
    assert cells[row:row + 5] == ["train-00000", "96", "90", "6", "93.8"]  # shard, rows in, ok, not_found, ok %
    total = cells.index("all shards")
    assert cells[total:total + 4] == ["all shards", "192", "183", "9"]
    assert "No row ended in: timeout." in "".join(page.text)


def test_rois_per_image_summary(page):
    cells = page.cells
    assert cells[cells.index("images with RoIs") + 1] == "5"
    assert cells[cells.index("fewest RoIs") + 1] == "10"
    assert cells[cells.index("most RoIs") + 1] == "30"
    assert cells[cells.index("rows without RoIs: decode_error") + 1] == "1"


def test_benchmark_table_per_rule(page):
    cells = page.cells
    row = cells.index("pretrain")
    assert cells[row:row + 6] == ["pretrain", "2", "150.0", "100.0", "148.0", "2500.0"]
    assert "evaluate" in cells and "world" in cells


def test_pretrain_summary_keeps_the_setting_without_steps(page):
    text = "".join(page.text)
    assert "not pre-trained: the BERT-initialised model" in text
    cells = page.cells
    assert cells[cells.index("c") + 1] == "5"  # setting c ran 5 steps


def test_loss_curves_read_every_loss_and_the_note(workdir, tmp_path):
    curves = read_loss_curves(workdir / "results/pretrain/c/metrics.jsonl", "c")
    assert curves.steps == [1, 2, 3, 4, 5]
    assert sorted(curves.losses) == ["loss", "mlm_loss", "rel_loss", "roi_loss"]
    assert curves.losses["loss"][-1] == 4.0
    none = read_loss_curves(workdir / "results/pretrain/none/metrics.jsonl", "none")
    assert none.steps == [] and none.note.startswith("not pre-trained")
    # a loss that appears only from step 2 on is a gap at step 1, not a shifted line
    late = write_jsonl(tmp_path / "late.jsonl", [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0, "x_loss": 1.0}])
    late_curves = read_loss_curves(late, "late")
    assert math.isnan(late_curves.losses["x_loss"][0]) and late_curves.losses["x_loss"][1] == 1.0


def test_bad_metrics_line_names_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": \n')
    with pytest.raises(ValueError, match=r"metrics.jsonl line 2: not valid JSON"):
        read_loss_curves(path, "x")
    path.write_text('{"step": 1, "lr": 1.0}\n')
    with pytest.raises(ValueError, match=r"line 1 \(step 1\) has no key 'loss'"):
        read_loss_curves(path, "x")


def test_shard_counts_must_add_up(tmp_path):
    path = tmp_path / "train-00000.stats.json"
    path.write_text(json.dumps({"counts": {"ok": 5, "not_found": 1}, "rows_in": 7, "split": "train", "shard": 0}))
    with pytest.raises(ValueError, match="add up to 6, but rows_in is 7"):
        read_shard_stats(path)


def test_roi_counts_read_ok_rows_and_count_the_rest(workdir):
    counts = count_rois(sorted((workdir / "results/rois/cc").glob("*.parquet")))
    assert sorted(counts.num_boxes.tolist()) == [10, 10, 12, 12, 30]
    assert counts.not_ok == {"decode_error": 1}


def test_roi_parquet_without_num_boxes_is_named(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"key": ["a"], "status": ["ok"]}), path)
    with pytest.raises(ValueError, match=r"bad.parquet: not a RoI parquet, missing columns \['error', 'image_w', 'image_h', 'num_boxes', 'num_classes'\]"):
        count_rois([path])


def test_benchmarks_are_read_by_rule_and_job(workdir):
    records = read_benchmarks(workdir / "benchmarks/rules")
    jobs = {(r.rule, r.job) for r in records}
    assert jobs == {("world", ""), ("pretrain", "a"), ("pretrain", "c"), ("evaluate", "vqa/a/half/val")}
    evaluate = next(r for r in records if r.rule == "evaluate")
    assert evaluate.values["max_vms"] is None and evaluate.values["max_rss"] == 37.5  # NA → None
    summary = {t.rule: t for t in summarise_benchmarks(records)}
    assert (summary["pretrain"].jobs, summary["pretrain"].total_s, summary["pretrain"].max_s) == (2, 150.0, 100.0)
    assert summarise_benchmarks(records)[0].rule == "pretrain"  # slowest first


def test_a_truncated_benchmark_file_is_named(tmp_path):
    write_benchmark(tmp_path / "rules/world.tsv")  # header only
    with pytest.raises(ValueError, match=r"world.tsv: not a Snakemake benchmark TSV"):
        read_benchmarks(tmp_path / "rules")


def test_report_without_benchmark_files_says_so(workdir, tmp_path):
    results = workdir / "results"
    out = tmp_path / "report"
    html = build_report(
        out / "index.html", {name: out / f for name, (f, _) in PLOTS.items()},
        tables_md=[results / "tables/table1_vcr.md"], pretrain_metrics=[results / "pretrain/a/metrics.jsonl"],
        finetune_metrics=[], shard_stats=[results / "shards/cc/train-00000.stats.json"],
        roi_parquets=[results / "rois/cc/train-00001.parquet"], benchmarks_dir=tmp_path / "no_benchmarks",
        config=CONFIG,
    )
    assert "Read at report time from the 0 files" in html.read_text(encoding="utf-8")
    assert all((out / f).read_bytes()[:8] == PNG_MAGIC for f, _ in PLOTS.values())
