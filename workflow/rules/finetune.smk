# Fine-tune every pre-trained model on VCR (Q→A, QA→R), VQA v2 and RefCOCO+.
# Schedule `full` is Tables 1–3; `half` (0.5× epochs) is Table 4. After training, the job predicts
# the task's held-out splits while the model is in memory; `evaluate` scores those predictions.


rule finetune:
    input:
        pretrained=pretrained_model,  # common_tasks.smk: results/pretrain/{setting}/ or pretrain.init_from
        rois=lambda wc: task_rois(wc.finetune_task, ["train"]),
        eval_rois=lambda wc: task_rois(wc.finetune_task, eval_splits(wc.finetune_task)),
        annotations=lambda wc: source_files(
            finetune_dataset(wc.finetune_task),
            ["train"] + eval_splits(wc.finetune_task),
        ),
    output:
        model="results/finetune/{finetune_task}/{setting}/{schedule}/model.safetensors",
        config="results/finetune/{finetune_task}/{setting}/{schedule}/config.json",
        metrics="results/finetune/{finetune_task}/{setting}/{schedule}/metrics.jsonl",
        predictions="results/finetune/{finetune_task}/{setting}/{schedule}/predictions.json",
    log:
        "logs/finetune/{finetune_task}/{setting}/{schedule}.log",
    benchmark:
        "benchmarks/rules/finetune/{finetune_task}/{setting}/{schedule}.tsv"
    conda:
        CONDA_ENV
    threads: 1
    resources:
        mem_mb=8000,
        runtime=600,
        gpu=1 if config["device"] == "cuda" else 0,
    params:
        **run_params("seed", "device", "max_image_pixels"),
        code=lambda wc: code("finetune", wc.finetune_task),
        task=lambda wc: wc.finetune_task,
        setting=lambda wc: wc.setting,
        schedule=lambda wc: wc.schedule,
        schedule_factor=lambda wc: config["finetune"]["schedules"][wc.schedule],
        hparams=lambda wc: stable(config["finetune"][wc.finetune_task]),
        tune_frcnn=config["finetune"]["tune_frcnn"],
        sentence_readout=config["finetune"]["sentence_readout"],
        model=stable(config["model"]),
        sources=lambda wc: stable(
            dataset_sources(finetune_dataset(wc.finetune_task), config["sources"])
        ),
        eval_targets=lambda wc: eval_targets(wc.finetune_task),
    script:
        "../scripts/finetune.py"
