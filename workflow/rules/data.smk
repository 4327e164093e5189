# Raw sources → webdataset shards: `fetch` downloads the configured source files (real configs),
# Conceptual Captions images → webdataset shards (+ per-row accounting), text corpora → text shards.

import re

# fetch.<name>: {url, path, bytes, checksum}; a source path that some entry fetches is made by rule fetch.
FETCH_NAME_BY_PATH = {entry["path"]: name for name, entry in config["fetch"].items()}

if FETCH_NAME_BY_PATH:

    rule fetch:
        output:
            path="{fetched}",
        log:
            "logs/fetch/{fetched}.log",
        benchmark:
            "benchmarks/rules/fetch/{fetched}.tsv"
        wildcard_constraints:
            fetched="|".join(re.escape(path) for path in FETCH_NAME_BY_PATH),
        retries: 2  # each retry resumes from the part file
        conda:
            CONDA_ENV
        threads: 1
        resources:
            mem_mb=1000,
            runtime=24 * 60,
        params:
            code=code("fetch"),
            name=lambda wc: FETCH_NAME_BY_PATH[wc.fetched],
            entry=lambda wc: stable(config["fetch"][FETCH_NAME_BY_PATH[wc.fetched]]),
            timeout_s=60,
            attempts=5,
        script:
            "../scripts/fetch.py"


rule partition_cc:
    input:
        tsv=lambda wc: config["sources"]["cc"][wc.split],
    output:
        rows="results/shards/cc/rows/{split}.parquet",
    log:
        "logs/partition_cc/{split}.log",
    benchmark:
        "benchmarks/rules/partition_cc/{split}.tsv"
    conda:
        CONDA_ENV
    threads: 1
    resources:
        mem_mb=2000,
        runtime=60,
    params:
        code=code("partition_cc"),
        split=lambda wc: wc.split,
        shard_rows=config["cc"]["shard_rows"],  # not num_shards: adding a shard must not re-cut the others
        expected_rows=lambda wc: config["cc"]["expected_rows"].get(wc.split),
    script:
        "../scripts/partition_cc.py"


rule download_cc:
    input:
        rows="results/shards/cc/rows/{split}.parquet",
    output:
        tar="results/shards/cc/{split}-{shard}.tar",
        parquet="results/shards/cc/{split}-{shard}.parquet",
        stats="results/shards/cc/{split}-{shard}.stats.json",
    log:
        "logs/download_cc/{split}-{shard}.log",
    benchmark:
        "benchmarks/rules/download_cc/{split}-{shard}.tsv"
    retries: 2
    conda:
        CONDA_ENV
    threads: 1
    resources:
        mem_mb=2000,
        runtime=120,
    params:
        **run_params("max_image_pixels"),
        code=code("download_cc"),
        split=lambda wc: wc.split,
        shard=lambda wc: int(wc.shard),
        resize=stable(config["cc"]["resize"]),
        download=stable(config["cc"]["download"]),
    script:
        "../scripts/download_cc.py"


rule shard_text:
    input:
        source=lambda wc: config["sources"][wc.corpus],
    output:
        # Every corpus gets text.num_shards shards, so one job per corpus has a static output list.
        tars=expand(
            "results/shards/text/{{corpus}}-{shard:05d}.tar",
            shard=range(config["text"]["num_shards"]),
        ),
        accounting="results/shards/text/{corpus}.parquet",
    log:
        "logs/shard_text/{corpus}.log",
    benchmark:
        "benchmarks/rules/shard_text/{corpus}.tsv"
    wildcard_constraints:
        corpus="books|wiki",
    conda:
        CONDA_ENV
    threads: config["text"]["processes"]  # worker processes stripping Wikipedia markup
    resources:
        mem_mb=4000,
        runtime=240,
    params:
        code=code("shard_text"),
        corpus=lambda wc: wc.corpus,
        num_shards=config["text"]["num_shards"],
        sentences_per_doc=config["text"]["sentences_per_doc"],
    script:
        "../scripts/shard_text.py"


rule shards:
    # `snakemake shards`: the data stage alone (every CC shard of cc.splits and every text shard).
    input:
        [tar for split in config["cc"]["splits"] for tar in cc_shards(split)],
        [tar for corpus in config["text"]["corpora"] for tar in text_shards(corpus)],
