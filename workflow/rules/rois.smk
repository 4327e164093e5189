# The ResNet-C4 Faster R-CNN and the per-image RoIs (DESIGN §4: score > 0.5, 10..100 boxes).
#
# The detector: trained on the data's COCO-style annotations (rule train_detector) when
# detector.weights is null, otherwise the checkpoint at that path (train_detector's format, see
# config/schema.yaml); train_detector is then not part of the DAG.
#
# The RoIs of each dataset (rois.source): detected by that detector (rules extract_rois,
# extract_task_rois) or imported from a bottom-up-attention TSV (rules import_rois,
# import_task_rois). Each output path has exactly one producing rule for a given config.

DETECTOR_MODEL = config["detector"]["weights"] or "results/detector/model.pt"
ROI_SOURCES = config["rois"]["source"]
# What the RoI jobs depend on in `rois:`; the sources choose rules and inputs, not job results.
# An import keeps the TSV's own selection, so only the box bounds and the batching reach it.
ROI_RULE_PARAMS = stable({k: v for k, v in config["rois"].items() if k != "source"})
ROI_IMPORT_PARAMS = stable(
    {
        k: config["rois"][k]
        for k in ("min_boxes", "max_boxes", "batch_size", "num_workers")
    }
)
TASK_DATASETS = roi_datasets()
# a config-declared task (tasks.custom) has no rois.source entry: its images are always detected
DETECTED_TASK_DATASETS = [
    d for d in TASK_DATASETS if ROI_SOURCES.get(d, "detector") == "detector"
]
IMPORTED_TASK_DATASETS = [
    d for d in TASK_DATASETS if ROI_SOURCES.get(d, "detector") != "detector"
]


if not config["detector"]["weights"]:

    rule train_detector:
        input:
            train=config["sources"]["detector"]["annotations"].format(split="train"),
            val=config["sources"]["detector"]["annotations"].format(split="val"),
        output:
            model="results/detector/model.pt",
            metrics="results/detector/metrics.json",
        log:
            "logs/train_detector.log",
        benchmark:
            "benchmarks/rules/train_detector.tsv"
        priority: 2  # on the critical path: detector -> CC RoIs -> pre-training
        conda:
            CONDA_ENV
        threads: 2
        resources:
            mem_mb=4000,
            runtime=120,
            gpu=1 if config["device"] == "cuda" else 0,
        params:
            **run_params("seed", "max_image_pixels"),
            code=code("train_detector"),
            detector=stable(config["detector"]),
            images=config["sources"]["detector"]["images"],
        script:
            "../scripts/train_detector.py"


if ROI_SOURCES["cc"] == "detector":

    rule extract_rois:
        input:
            tar="results/shards/cc/{split}-{shard}.tar",
            model=DETECTOR_MODEL,
        output:
            parquet="results/rois/cc/{split}-{shard}.parquet",
        log:
            "logs/extract_rois/cc/{split}-{shard}.log",
        benchmark:
            "benchmarks/rules/extract_rois/cc/{split}-{shard}.tsv"
        priority: 2  # before the task RoIs, which only fine-tuning needs
        conda:
            CONDA_ENV
        threads: 1
        resources:
            mem_mb=4000,
            runtime=120,
            gpu=1 if config["device"] == "cuda" else 0,
        params:
            **run_params("device", "max_image_pixels"),
            code=code("extract_rois"),
            rois=ROI_RULE_PARAMS,
        script:
            "../scripts/extract_rois.py"

else:

    rule import_rois:
        input:
            tar="results/shards/cc/{split}-{shard}.tar",
            tsv=lambda wc: roi_tsv("cc", wc.split, wc.shard),
            model=DETECTOR_MODEL,  # its class space, and its box head scores boxes of a TSV without cls_prob
        output:
            parquet="results/rois/cc/{split}-{shard}.parquet",
        log:
            "logs/import_rois/cc/{split}-{shard}.log",
        benchmark:
            "benchmarks/rules/import_rois/cc/{split}-{shard}.tsv"
        conda:
            CONDA_ENV
        threads: 1
        resources:
            mem_mb=4000,
            runtime=120,
            gpu=1 if config["device"] == "cuda" else 0,
        params:
            **run_params("device", "max_image_pixels"),
            code=code("extract_rois"),
            rois=ROI_IMPORT_PARAMS,
        script:
            "../scripts/extract_rois.py"


if DETECTED_TASK_DATASETS:

    rule extract_task_rois:
        input:
            annotations=lambda wc: source_files(wc.dataset, [wc.split]),
            model=DETECTOR_MODEL,
        output:
            parquet="results/rois/{dataset}/{split}.parquet",
        log:
            "logs/extract_rois/{dataset}/{split}.log",
        benchmark:
            "benchmarks/rules/extract_rois/{dataset}/{split}.tsv"
        wildcard_constraints:
            dataset="|".join(DETECTED_TASK_DATASETS),
            split="|".join(["train", *EVAL_SPLITS]),
        conda:
            CONDA_ENV
        threads: 1
        resources:
            mem_mb=4000,
            runtime=120,
            gpu=1 if config["device"] == "cuda" else 0,
        params:
            **run_params("device", "max_image_pixels"),
            code=lambda wc: code("extract_task_rois", wc.dataset),
            dataset=lambda wc: wc.dataset,
            split=lambda wc: wc.split,
            sources=lambda wc: stable(dataset_sources(wc.dataset, config["sources"])),
            rois=ROI_RULE_PARAMS,
        script:
            "../scripts/extract_task_rois.py"


if IMPORTED_TASK_DATASETS:

    rule import_task_rois:
        input:
            annotations=lambda wc: source_files(wc.dataset, [wc.split]),
            tsv=lambda wc: roi_tsv(wc.dataset, wc.split),
            model=DETECTOR_MODEL,
        output:
            parquet="results/rois/{dataset}/{split}.parquet",
        log:
            "logs/import_rois/{dataset}/{split}.log",
        benchmark:
            "benchmarks/rules/import_rois/{dataset}/{split}.tsv"
        wildcard_constraints:
            dataset="|".join(IMPORTED_TASK_DATASETS),
            split="|".join(["train", *EVAL_SPLITS]),
        conda:
            CONDA_ENV
        threads: 1
        resources:
            mem_mb=4000,
            runtime=120,
            gpu=1 if config["device"] == "cuda" else 0,
        params:
            **run_params("device", "max_image_pixels"),
            code=lambda wc: code("extract_task_rois", wc.dataset),
            dataset=lambda wc: wc.dataset,
            split=lambda wc: wc.split,
            sources=lambda wc: stable(dataset_sources(wc.dataset, config["sources"])),
            rois=ROI_IMPORT_PARAMS,
        script:
            "../scripts/extract_task_rois.py"
