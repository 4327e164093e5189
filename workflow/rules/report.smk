# The run report: one HTML page with the four tables, the pre-training and fine-tuning loss curves,
# the CC download accounting, RoIs per image, the per-rule timings and the config
# (vlbert_core/report). Outputs flagged with report() here and in the other rule modules are what
# `snakemake --report report.html` collects.


report: "../report/workflow.rst"


REPORT = "results/report/index.html"


def report_finetune_metrics():
    """The metrics.jsonl of every fine-tune job behind the tables (half: Table 4, full: Tables 1-3)."""
    jobs = [(setting, "half") for setting in config["pretrain"]["settings"]]
    jobs += [(setting, "full") for setting in PAPER_TABLE_SETTINGS]
    return [
        f"results/finetune/{task}/{setting}/{schedule}/metrics.jsonl"
        for task in FINETUNE_TASKS
        for setting, schedule in jobs
    ]


def report_figure(name):
    return report(f"results/report/{name}.png", caption=f"../report/{name}.rst", category="Run report")


rule report:
    input:
        tables=TABLES,
        pretrain_metrics=expand(
            "results/pretrain/{setting}/metrics.jsonl", setting=config["pretrain"]["settings"]
        ),
        finetune_metrics=report_finetune_metrics(),
        shard_stats=[
            f"results/shards/cc/{split}-{shard}.stats.json"
            for split in config["cc"]["splits"]
            for shard in cc_shard_ids(split)
        ],
        roi_parquets=[pq for split in config["cc"]["splits"] for pq in cc_roi_parquets(split)],
        # Not inputs: benchmarks/rules/**/*.tsv. Snakemake writes them when a job ends, no rule
        # makes them; the script reads whatever exists when it runs.
    output:
        html=report(REPORT, caption="../report/index.rst", category="Run report"),
        pretrain_loss=report_figure("pretrain_loss"),
        finetune_loss=report_figure("finetune_loss"),
        downloads=report_figure("downloads"),
        rois_per_image=report_figure("rois_per_image"),
        benchmarks=report_figure("benchmarks"),
    params:
        code=code("report"),
        config=stable(config),
        benchmarks_dir="benchmarks/rules",
    log:
        "logs/report.log",
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    script:
        "../scripts/report.py"
