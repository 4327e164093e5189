# The run report: one HTML page with the four tables, the pre-training and fine-tuning loss curves,
# the CC download accounting, RoIs per image, the per-rule timings and the config
# (vlbert_core/report). Outputs flagged with report() here and in the other rule modules are what
# `snakemake --report report.html` collects.


report: "../report/workflow.rst"


REPORT = "results/report/index.html"


rule report:
    input:
        tables=TABLES,
        pretrain_metrics=expand(
            "results/pretrain/{setting}/metrics.jsonl",
            setting=config["pretrain"]["settings"],
        ),
        finetune_metrics=report_finetune_metrics(),
        shard_stats=[
            f"results/shards/cc/{split}-{shard}.stats.json"
            for split in config["cc"]["splits"]
            for shard in cc_shard_ids(split)
        ],
        roi_parquets=[
            pq for split in config["cc"]["splits"] for pq in cc_roi_parquets(split)
        ],
        # Not inputs: benchmarks/rules/**/*.tsv. Snakemake writes them when a job ends, no rule
        # makes them; the script reads whatever exists when it runs.
    output:
        html=report(REPORT, caption="../report/index.rst", category="Run report"),
        pretrain_loss=report_figure("pretrain_loss"),
        finetune_loss=report_figure("finetune_loss"),
        downloads=report_figure("downloads"),
        rois_per_image=report_figure("rois_per_image"),
        benchmarks=report_figure("benchmarks"),
    log:
        "logs/report.log",
    conda:
        CONDA_ENV
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    params:
        code=code("report"),
        config=stable(config),
        benchmarks_dir="benchmarks/rules",
    script:
        "../scripts/report.py"
