# Table 4 over training seeds (config/seeds.yaml; not part of the default run). The pretrain, finetune
# and evaluate rules are reused with their outputs under results/seeds/{seed}/ and `seed` set from
# the path; the world, detector and RoIs are the default run's (common_seeds.smk: seed helpers).


use rule pretrain as pretrain_seed with:
    output:
        **seeded_outputs(rules.pretrain),
    log:
        "logs/seeds/{seed}/pretrain/{setting}.log",
    benchmark:
        "benchmarks/rules/seeds/{seed}/pretrain/{setting}.tsv"
    params:
        seed=lambda wc: int(wc.seed),


use rule finetune as finetune_seed with:
    input:
        **inputs_with(rules.finetune, pretrained=seed_pretrained_model),
    output:
        **seeded_outputs(rules.finetune),
    log:
        "logs/seeds/{seed}/finetune/{finetune_task}/{setting}/{schedule}.log",
    benchmark:
        "benchmarks/rules/seeds/{seed}/finetune/{finetune_task}/{setting}/{schedule}.tsv"
    params:
        seed=lambda wc: int(wc.seed),


use rule evaluate as evaluate_seed with:
    input:
        **inputs_with(rules.evaluate, predictions=seeded_finetune_predictions(SEED_DIR)),
    output:
        **seeded_outputs(rules.evaluate),
    log:
        "logs/seeds/{seed}/evaluate/{eval_task}/{setting}/{schedule}/{split}.log",
    benchmark:
        "benchmarks/rules/seeds/{seed}/evaluate/{eval_task}/{setting}/{schedule}/{split}.tsv"


rule table4_seeds:
    input:
        seed_table_evals,
    output:
        csv="results/tables/table4_seeds.csv",
        md="results/tables/table4_seeds.md",
    log:
        "logs/table4_seeds.log",
    conda:
        CONDA_ENV
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    params:
        code=code("table4_seeds"),
        seeds=config["seeds"],
        default_seed=config["seed"],
        settings=list(config["pretrain"]["settings"]),
        dataset=config["dataset"],
    script:
        "../scripts/table4_seeds.py"


# The default run's comparison over fine-tuning seeds (config `finetune_seeds`): the pre-trained models
# of results/pretrain/ fine-tuned again with each seed, under results/finetune_seeds/{fseed}/.


use rule finetune as finetune_fseed with:
    output:
        **seeded_outputs(rules.finetune, FINETUNE_SEED_DIR),
    log:
        "logs/finetune_seeds/{fseed}/finetune/{finetune_task}/{setting}/{schedule}.log",
    benchmark:
        "benchmarks/rules/finetune_seeds/{fseed}/finetune/{finetune_task}/{setting}/{schedule}.tsv"
    params:
        seed=lambda wc: int(wc.fseed),


use rule evaluate as evaluate_fseed with:
    input:
        **inputs_with(
            rules.evaluate, predictions=seeded_finetune_predictions(FINETUNE_SEED_DIR)
        ),
    output:
        **seeded_outputs(rules.evaluate, FINETUNE_SEED_DIR),
    log:
        "logs/finetune_seeds/{fseed}/evaluate/{eval_task}/{setting}/{schedule}/{split}.log",
    benchmark:
        "benchmarks/rules/finetune_seeds/{fseed}/evaluate/{eval_task}/{setting}/{schedule}/{split}.tsv"


rule finetune_seeds_table:
    input:
        finetune_seed_table_evals,
    output:
        csv="results/tables/finetune_seeds.csv",
        md="results/tables/finetune_seeds.md",
    log:
        "logs/finetune_seeds_table.log",
    conda:
        CONDA_ENV
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    params:
        code=code("finetune_seeds_table"),
        seeds=config["finetune_seeds"],
        default_seed=config["seed"],
        settings=PAPER_TABLE_SETTINGS,
        dataset=config["dataset"],
    script:
        "../scripts/finetune_seeds_table.py"
