# One VL-BERT pre-training per Table 4 setting. Setting `none` is the BERT initialisation itself.
# pretrain.launch (nodes x processes_per_node) decides how many processes train it: one runs inside
# the script; more are started by torchrun, across nodes by srun + torchrun
# (vlbert_core/pretrain/launch.py), and the resources below ask SLURM for that allocation.


rule pretrain:
    input:
        cc_shards=pretrain_cc_shards,
        roi_parquets=pretrain_roi_parquets,
        text_shards=pretrain_text_shards,
        detector=DETECTOR_MODEL,  # rois.smk: detector.weights or results/detector/model.pt
        bert=bert_checkpoint_input(),  # weights.smk: model.bert_path when a rule makes it
        start=pretrain_start_input,  # common_tasks.smk: pretrain.init_from when pretrain.continue_init_from
    output:
        model="results/pretrain/{setting}/model.safetensors",
        heads="results/pretrain/{setting}/heads.safetensors",
        config="results/pretrain/{setting}/config.json",
        metrics="results/pretrain/{setting}/metrics.jsonl",
        visual_clue="results/pretrain/{setting}/visual_clue.json",
    log:
        "logs/pretrain/{setting}.log",
    benchmark:
        "benchmarks/rules/pretrain/{setting}.tsv"
    priority: 1  # every pre-training starts before more fine-tuning: the last one ends sooner
    conda:
        CONDA_ENV
    threads: 1
    resources:
        **pretrain_resources(),
    params:
        **run_params("seed", "device", "max_image_pixels"),
        setting=lambda wc: wc.setting,
        init_from=pretrain_start,
        model=stable(config["model"]),
        pretrain=stable(
            {k: v for k, v in config["pretrain"].items() if k != "settings"}
        ),
        code=code("pretrain"),
    script:
        "../scripts/pretrain.py"
