# The embedded synthetic world: scenes rendered to JPEGs and every raw file in its official format.
# Real configs (dataset: real) point `sources:` at downloaded data and never run this rule.


if config["dataset"] == "synthetic":

    rule world:
        output:
            world_outputs(),
            summary="resources/synthetic/world.json",
        log:
            "logs/world.log",
        benchmark:
            "benchmarks/rules/world.tsv"
        conda:
            CONDA_ENV
        threads: 1
        resources:
            mem_mb=2000,
            runtime=30,
        params:
            **run_params("seed"),
            code=code("world"),
            world=stable(config["world"]),
            sources=stable(config["sources"]),
        script:
            "../scripts/world.py"
