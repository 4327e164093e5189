# The paper's Tables 1–4 with our measured numbers beside the reported ones (CSV + Markdown twin).


rule tables:
    input:
        **{table: table_evals(table) for table in TABLE_SPECS},
    output:
        [
            report(path, caption="../report/tables.rst", category="Result tables")
            for path in TABLES
        ],
    log:
        "logs/tables.log",
    conda:
        CONDA_ENV
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    params:
        code=code("tables"),
        dataset=config["dataset"],
        settings=FINETUNE_SETTINGS,
        released_from=INIT_FROM,
        model=stable(config["model"]),
    script:
        "../scripts/tables.py"
