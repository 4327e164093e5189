# VL-BERT vs ViLBERT under one controlled setup (not part of the default run):
#   uv run snakemake --cores all results/tables/model_comparison.csv
# Each ViLBERT setting (vilbert_none, vilbert) beside the VL-BERT setting it is compared with (none, c), on the
# same shards, RoIs, steps, Table 4 fine-tuning schedule and seeds (compare.seeds). The pretrain, finetune and
# evaluate rules are the default run's and the seeded copies of seeds.smk; the config's own seed is results/.


rule model_comparison:
    input:
        evals=comparison_evals,  # common_seeds.smk
        pretrained=comparison_pretrained,
        retrieval=retrieval_evals,
    output:
        csv=COMPARISON_TABLES[0],
        md=COMPARISON_TABLES[1],
        retrieval_csv=COMPARISON_TABLES[2],
        retrieval_md=COMPARISON_TABLES[3],
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


# Zero-shot image retrieval (Flickr30k format) with a pre-trained model's image-caption head alone, for the
# comparison's settings that train one (c, vilbert); the fine-tuned retrieval comes from rules finetune/evaluate.


rule zero_shot_retrieval:
    input:
        model="results/pretrain/{setting}/model.safetensors",
        heads="results/pretrain/{setting}/heads.safetensors",
        rois=lambda wc: task_rois("retrieval", ["test"]),
        annotations=lambda wc: source_files("flickr30k", ["test"]),
    output:
        predictions="results/zero_shot/retrieval/{setting}/predictions.json",
        json="results/zero_shot/retrieval/{setting}/test.json",
        scored="results/zero_shot/retrieval/{setting}/test.predictions.json",
    log:
        "logs/zero_shot/retrieval/{setting}.log",
    benchmark:
        "benchmarks/rules/zero_shot/retrieval/{setting}.tsv"
    conda:
        CONDA_ENV
    threads: 1
    resources:
        mem_mb=4000,
        runtime=60,
    params:
        **run_params("device", "max_image_pixels"),
        code=code("zero_shot_retrieval", "retrieval"),
        setting=lambda wc: wc.setting,
        split="test",
        sources=stable(dataset_sources("flickr30k", config["sources"])),
        model=stable(config["model"]),
        max_text_len=config["finetune"]["retrieval"].get("max_text_len", 64),
        dataset=config["dataset"],
    script:
        "../scripts/zero_shot_retrieval.py"


use rule zero_shot_retrieval as zero_shot_retrieval_seed with:
    input:
        **inputs_with(
            rules.zero_shot_retrieval,
            model="results/seeds/{seed}/pretrain/{setting}/model.safetensors",
            heads="results/seeds/{seed}/pretrain/{setting}/heads.safetensors",
        ),
    output:
        **seeded_outputs(rules.zero_shot_retrieval),
    log:
        "logs/seeds/{seed}/zero_shot/retrieval/{setting}.log",
    benchmark:
        "benchmarks/rules/seeds/{seed}/zero_shot/retrieval/{setting}.tsv"
