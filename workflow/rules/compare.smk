# VL-BERT vs ViLBERT under one controlled setup (not part of the default run):
#   uv run snakemake --cores all results/tables/model_comparison.csv
# Each ViLBERT setting (vilbert_none, vilbert) beside the VL-BERT setting it is compared with (none, c), on the
# same shards, RoIs, steps, Table 4 fine-tuning schedule and seeds (compare.seeds). The pretrain, finetune and
# evaluate rules are the default run's and the seeded copies of seeds.smk; the config's own seed is results/.


rule model_comparison:
    input:
        evals=comparison_evals,  # common.smk
        pretrained=comparison_pretrained,
    output:
        csv=COMPARISON_TABLES[0],
        md=COMPARISON_TABLES[1],
    log:
        "logs/model_comparison.log",
    benchmark:
        "benchmarks/rules/model_comparison.tsv"
    conda:
        CONDA_ENV
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    params:
        code=code("model_comparison"),
        seeds=config["compare"]["seeds"],
        default_seed=config["seed"],
        dataset=config["dataset"],
    script:
        "../scripts/model_comparison.py"
