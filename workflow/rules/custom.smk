# Your own image–text classification tasks (`tasks.custom.<name>`, docs/own-data.md). The Snakefile
# registers one task per entry, so its RoIs, fine-tunes and evaluations are the shared rules' jobs
# (task `custom_<name>`); this module adds the row checks, the table and the world's example data.


CUSTOM_TABLES = expand(
    "results/tables/custom_{name}.{ext}", name=list(CUSTOM_SPECS), ext=["csv", "md"]
)
CUSTOM_EXAMPLE_DIR = "resources/synthetic/custom/example"


rule custom_example:
    output:
        train=f"{CUSTOM_EXAMPLE_DIR}/train.jsonl",
        val=f"{CUSTOM_EXAMPLE_DIR}/val.csv",
    log:
        "logs/custom_example.log",
    conda:
        CONDA_ENV
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    params:
        **run_params("seed"),
        code=code("custom_example"),
        image_size=config["world"]["image_size"],
    script:
        "../scripts/custom_example.py"


rule custom_rows:
    input:
        train=lambda wc: CUSTOM_SPECS[wc.name].train,
        val=lambda wc: CUSTOM_SPECS[wc.name].val,
    output:
        train="results/custom/{name}/train.rows.jsonl",
        val="results/custom/{name}/val.rows.jsonl",
        labels="results/custom/{name}/labels.json",
    log:
        "logs/custom_rows/{name}.log",
    wildcard_constraints:
        name="|".join(CUSTOM_SPECS) or "^$",
    conda:
        CONDA_ENV
    threads: 1
    resources:
        mem_mb=2000,
        runtime=60,
    params:
        **run_params("max_image_pixels"),
        code=code("custom_rows"),
        name=lambda wc: wc.name,
        entry=lambda wc: stable(config["tasks"]["custom"][wc.name]),
    script:
        "../scripts/custom_rows.py"


rule custom_table:
    input:
        evals=lambda wc: [
            eval_json(
                f"custom_{wc.name}", setting, CUSTOM_SPECS[wc.name].schedule, "val"
            )
            for setting in custom_settings(wc.name)
        ],
        labels="results/custom/{name}/labels.json",
        train_rows="results/custom/{name}/train.rows.jsonl",
        val_rows="results/custom/{name}/val.rows.jsonl",
    output:
        csv="results/tables/custom_{name}.csv",
        md="results/tables/custom_{name}.md",
    log:
        "logs/custom_table/{name}.log",
    wildcard_constraints:
        name="|".join(CUSTOM_SPECS) or "^$",
    conda:
        CONDA_ENV
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    params:
        code=code("custom_table"),
        name=lambda wc: wc.name,
        entry=lambda wc: stable(config["tasks"]["custom"][wc.name]),
        settings=lambda wc: custom_settings(wc.name),
        dataset=config["dataset"],
        model=stable(config["model"]),
    script:
        "../scripts/custom_table.py"
