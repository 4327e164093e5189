# Official metrics on held-out splits, from the fine-tune jobs' predictions and the datasets' own
# annotation files (torch-free, like an evaluation server). Every eval JSON names its predictions file.


rule evaluate:
    input:
        predictions=lambda wc: finetune_predictions(
            eval_to_finetune_task(wc.eval_task), wc.setting, wc.schedule
        ),
        # and the train split's: a majority baseline counts its answers (Task.baseline)
        annotations=lambda wc: source_files(
            finetune_dataset(eval_to_finetune_task(wc.eval_task)), [wc.split, "train"]
        ),
        # the detected RoIs, for a baseline whose candidates they are (Task.baseline_reads_rois)
        rois=lambda wc: baseline_rois(wc.eval_task, wc.split),
    output:
        json="results/eval/{eval_task}/{setting}/{schedule}/{split}.json",
        predictions="results/eval/{eval_task}/{setting}/{schedule}/{split}.predictions.json",
    log:
        "logs/evaluate/{eval_task}/{setting}/{schedule}/{split}.log",
    benchmark:
        "benchmarks/rules/evaluate/{eval_task}/{setting}/{schedule}/{split}.tsv"
    wildcard_constraints:
        split="|".join(EVAL_SPLITS),
    conda:
        CONDA_ENV
    threads: 1
    resources:
        mem_mb=2000,
        runtime=30,
    params:
        code=lambda wc: code("evaluate", wc.eval_task),
        task=lambda wc: wc.eval_task,
        split=lambda wc: wc.split,
        setting=lambda wc: wc.setting,
        schedule=lambda wc: wc.schedule,
        sources=lambda wc: stable(
            dataset_sources(
                finetune_dataset(eval_to_finetune_task(wc.eval_task)),
                config["sources"],
            )
        ),
        dataset=config["dataset"],
        max_rois=config["model"]["max_rois"],
    script:
        "../scripts/evaluate.py"


if DERIVED_EVAL_TASKS:

    # Eval tasks scored from other eval tasks' predictions (VCR Q->AR), by the task that derives them.
    rule derive_eval:
        input:
            unpack(
                lambda wc: derived_eval_inputs(
                    wc.derived_task, wc.setting, wc.schedule, wc.split
                )
            ),
        output:
            json="results/eval/{derived_task}/{setting}/{schedule}/{split}.json",
        log:
            "logs/evaluate/{derived_task}/{setting}/{schedule}/{split}.log",
        benchmark:
            "benchmarks/rules/derive_eval/{derived_task}/{setting}/{schedule}/{split}.tsv"
        wildcard_constraints:
            derived_task="|".join(DERIVED_EVAL_TASKS),
        conda:
            CONDA_ENV
        threads: 1
        resources:
            mem_mb=1000,
            runtime=10,
        params:
            code=lambda wc: code("derive_eval", wc.derived_task),
            task=lambda wc: wc.derived_task,
            setting=lambda wc: wc.setting,
            schedule=lambda wc: wc.schedule,
            split=lambda wc: wc.split,
            dataset=config["dataset"],
        script:
            "../scripts/derive_eval.py"
