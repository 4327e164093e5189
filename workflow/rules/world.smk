# The embedded synthetic world: scenes rendered to JPEGs and every raw file in its official format.
# Real configs (dataset: real) point `sources:` at downloaded data and never run this rule.


def world_outputs():
    src = config["sources"]
    files = list(src["cc"].values()) + [src["books"], src["wiki"]]
    for dataset in task_datasets():
        files += source_files(dataset, dataset_splits(dataset))
    files += source_files("detector", ["train", "val"])
    return sorted(set(files))


if config["dataset"] == "synthetic":

    rule world:
        output:
            world_outputs(),
            summary="resources/synthetic/world.json",
        params:
            code=code("world"),
            world=stable(config["world"]),
            sources=stable(config["sources"]),
            seed=config["seed"],
        log:
            "logs/world.log",
        benchmark:
            "benchmarks/rules/world.tsv"
        threads: 1
        resources:
            mem_mb=2000,
            runtime=30,
        script:
            "../scripts/world.py"
