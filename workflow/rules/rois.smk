# The ResNet-C4 Faster R-CNN and the per-image RoIs (DESIGN §4: score > 0.5, 10..100 boxes).

from snakemake.exceptions import WorkflowError

if config["detector"]["weights"]:
    raise WorkflowError(
        f"detector.weights = {config['detector']['weights']!r}: loading published detector weights "
        "is not built yet; set detector.weights to null to train the detector on the data's "
        "COCO-style annotations (rule train_detector)"
    )


rule train_detector:
    input:
        train=config["sources"]["detector"]["annotations"].format(split="train"),
        val=config["sources"]["detector"]["annotations"].format(split="val"),
    output:
        model="results/detector/model.pt",
        metrics="results/detector/metrics.json",
    params:
        detector=stable(config["detector"]),
        images=config["sources"]["detector"]["images"],
        seed=config["seed"],
    log:
        "logs/train_detector.log",
    benchmark:
        "benchmarks/rules/train_detector.tsv"
    threads: 2
    resources:
        mem_mb=4000,
        runtime=120,
        gpu=1 if config["device"] == "cuda" else 0,
    script:
        "../scripts/train_detector.py"


rule extract_rois:
    input:
        tar="results/shards/cc/{split}-{shard}.tar",
        model=rules.train_detector.output.model,
    output:
        parquet="results/rois/cc/{split}-{shard}.parquet",
    params:
        rois=stable(config["rois"]),
        device=config["device"],
    log:
        "logs/extract_rois/cc/{split}-{shard}.log",
    benchmark:
        "benchmarks/rules/extract_rois/cc/{split}-{shard}.tsv"
    threads: 1
    resources:
        mem_mb=4000,
        runtime=120,
        gpu=1 if config["device"] == "cuda" else 0,
    script:
        "../scripts/extract_rois.py"


rule extract_task_rois:
    input:
        annotations=lambda wc: source_files(wc.dataset, [wc.split]),
        model=rules.train_detector.output.model,
    output:
        parquet="results/rois/{dataset}/{split}.parquet",
    params:
        dataset=lambda wc: wc.dataset,
        split=lambda wc: wc.split,
        sources=lambda wc: stable(config["sources"][wc.dataset]),
        rois=stable(config["rois"]),
        device=config["device"],
    log:
        "logs/extract_rois/{dataset}/{split}.log",
    benchmark:
        "benchmarks/rules/extract_rois/{dataset}/{split}.tsv"
    wildcard_constraints:
        dataset="vqa|refcoco",
        split="train|val|testA|testB",
    threads: 1
    resources:
        mem_mb=4000,
        runtime=120,
        gpu=1 if config["device"] == "cuda" else 0,
    script:
        "../scripts/extract_task_rois.py"
