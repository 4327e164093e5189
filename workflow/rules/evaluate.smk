# Official metrics on held-out splits; every eval JSON names its predictions file.


rule evaluate:
    input:
        model=lambda wc: finetune_outputs(eval_to_finetune_task(wc.eval_task), wc.setting, wc.schedule),
        rois=lambda wc: task_rois(wc.eval_task, [wc.split]) if wc.eval_task != "refcoco_gt" else [],
        annotations=lambda wc: source_files(
            finetune_dataset(eval_to_finetune_task(wc.eval_task)), [wc.split]
        ),
    output:
        json="results/eval/{eval_task}/{setting}/{schedule}/{split}.json",
        predictions="results/eval/{eval_task}/{setting}/{schedule}/{split}.predictions.json",
    params:
        task=lambda wc: wc.eval_task,
        split=lambda wc: wc.split,
        setting=lambda wc: wc.setting,
        schedule=lambda wc: wc.schedule,
        sources=lambda wc: config["sources"][finetune_dataset(eval_to_finetune_task(wc.eval_task))],
        model=config["model"],
        dataset=config["dataset"],
        seed=config["seed"],
        device=config["device"],
    log:
        "logs/evaluate/{eval_task}/{setting}/{schedule}/{split}.log",
    benchmark:
        "benchmarks/rules/evaluate/{eval_task}/{setting}/{schedule}/{split}.tsv"
    wildcard_constraints:
        split="val|testA|testB",
    threads: 1
    resources:
        mem_mb=4000,
        runtime=120,
        gpu=1 if config["device"] == "cuda" else 0,
    script:
        "../scripts/evaluate.py"


rule vcr_q2ar:
    input:
        q2a="results/eval/vcr_q2a/{setting}/{schedule}/{split}.predictions.json",
        qa2r="results/eval/vcr_qa2r/{setting}/{schedule}/{split}.predictions.json",
    output:
        json="results/eval/vcr_q2ar/{setting}/{schedule}/{split}.json",
    params:
        setting=lambda wc: wc.setting,
        schedule=lambda wc: wc.schedule,
        split=lambda wc: wc.split,
        dataset=config["dataset"],
    log:
        "logs/evaluate/vcr_q2ar/{setting}/{schedule}/{split}.log",
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    script:
        "../scripts/vcr_q2ar.py"
