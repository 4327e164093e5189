# The paper's Tables 1–4 with our measured numbers beside the reported ones (CSV + Markdown twin).


rule tables:
    input:
        table1=table1_evals(),
        table2=table2_evals(),
        table3=table3_evals(),
        table4=table4_evals(),
    output:
        [report(path, caption="../report/tables.rst", category="Result tables") for path in TABLES],
    params:
        code=code("tables"),
        dataset=config["dataset"],
        settings=FINETUNE_SETTINGS,
        released_from=INIT_FROM,
        model=stable(config["model"]),
    log:
        "logs/tables.log",
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    script:
        "../scripts/tables.py"
