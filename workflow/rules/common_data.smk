# Helpers: the data stage's paths for this config. The raw source files of a dataset and what the world
# writes of them, the CC and text shards, the RoI parquets (CC shards, task datasets) and bottom-up
# TSVs, and the shards and RoIs a pre-training reads (rules world, data, rois, pretrain, report). The
# rules also use dataset_sources (a task dataset's configured files) and roi_datasets (rois.smk).

from vlbert_core.tasks.registry import (
    dataset_sources,
    dataset_splits,
    roi_datasets,
    task_of_name,
    world_task_datasets,
)


def source_files(dataset, splits):
    """The raw files of a task dataset, with `{split}` templates filled in."""
    files = []
    for key, path in dataset_sources(dataset, config["sources"]).items():
        if key == "images":
            continue  # image folders are not tracked as files; their annotation files are
        files.extend(sorted({path.format(split=s) for s in splits}))
    return files


def world_outputs():
    src = config["sources"]
    files = list(src["cc"].values()) + [src["books"], src["wiki"]]
    for dataset in world_task_datasets():
        files += source_files(dataset, dataset_splits(dataset))
    files += source_files("detector", ["train", "val"])
    return sorted(set(files))


def cc_shard_ids(split):
    return [f"{i:05d}" for i in range(config["cc"]["num_shards"][split])]


def cc_shards(split):
    return expand(
        "results/shards/cc/{split}-{shard}.tar", split=split, shard=cc_shard_ids(split)
    )


def cc_roi_parquets(split):
    return expand(
        "results/rois/cc/{split}-{shard}.parquet",
        split=split,
        shard=cc_shard_ids(split),
    )


def text_shards(corpus):
    n = config["text"]["num_shards"]
    return [f"results/shards/text/{corpus}-{i:05d}.tar" for i in range(n)]


def roi_tsv(dataset, split, shard=None):
    """The bottom-up TSV of a dataset's split (and CC shard): rois.source with {split}/{shard} filled in."""
    path = ROI_SOURCES[dataset].replace("{split}", split)
    return path.replace("{shard}", shard) if shard is not None else path


def task_rois(task, splits):
    """The detected-RoI parquets a task reads (none for a task that uses its dataset's own boxes)."""
    dataset = task_of_name(task).roi_dataset
    return (
        [f"results/rois/{dataset}/{split}.parquet" for split in splits]
        if dataset
        else []
    )


def baseline_rois(eval_task, split):
    """The RoI parquets an eval task's baseline reads (Task.baseline_reads_rois): its split's, or none."""
    if not task_of_eval(eval_task).baseline_reads_rois(eval_task):
        return []
    return task_rois(eval_to_finetune_task(eval_task), [split])


def pretrain_cc_shards(wildcards):
    return [tar for split in config["cc"]["splits"] for tar in cc_shards(split)]


def pretrain_roi_parquets(wildcards):
    return [pq for split in config["cc"]["splits"] for pq in cc_roi_parquets(split)]


def pretrain_text_shards(wildcards):
    return [tar for corpus in config["text"]["corpora"] for tar in text_shards(corpus)]
