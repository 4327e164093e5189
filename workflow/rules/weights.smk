# Published weights made by the workflow:
# - `stand_ins:` random-valued stand-ins of published files (rehearsal only: config/rehearsal.yaml), laid out
#   as the published ones (vlbert_core/convert/stand_in.py), so the converters and loaders run the real path;
# - `convert:` published files converted to our formats by `python -m vlbert_core.convert` (rule
#   convert_weights; a vl-bert model directory by rule convert_vlbert), e.g. detector.weights or
#   pretrain.init_from. Each entry's key is the path it writes.

if MANIFEST_STAND_INS:

    rule stand_in:
        input:
            manifest=lambda wc: MANIFEST_DIR
            / MANIFEST_STAND_INS[wc.stand_in]["manifest"],
        output:
            path="{stand_in}",
        log:
            "logs/stand_in/{stand_in}.log",
        benchmark:
            "benchmarks/rules/stand_in/{stand_in}.tsv"
        wildcard_constraints:
            stand_in="|".join(re.escape(path) for path in MANIFEST_STAND_INS),
        conda:
            CONDA_ENV
        threads: 1
        resources:
            mem_mb=4000,
            runtime=10,
        params:
            code=code("stand_in"),
            entry=lambda wc: stable(MANIFEST_STAND_INS[wc.stand_in]),
        script:
            "../scripts/stand_in.py"


if BERT_STAND_INS:

    rule stand_in_bert:
        output:
            path=directory("{bert_stand_in}"),
        log:
            "logs/stand_in/{bert_stand_in}.log",
        benchmark:
            "benchmarks/rules/stand_in/{bert_stand_in}.tsv"
        wildcard_constraints:
            bert_stand_in="|".join(re.escape(path) for path in BERT_STAND_INS),
        conda:
            CONDA_ENV
        threads: 1
        resources:
            mem_mb=4000,
            runtime=10,
        params:
            code=code("stand_in"),
            entry=lambda wc: stable(BERT_STAND_INS[wc.bert_stand_in]),
        script:
            "../scripts/stand_in.py"


if FILE_CONVERSIONS:

    rule convert_weights:
        input:
            unpack(lambda wc: conversion_inputs(FILE_CONVERSIONS[wc.converted])),
        output:
            path="{converted}",
        log:
            "logs/convert/{converted}.log",
        benchmark:
            "benchmarks/rules/convert/{converted}.tsv"
        wildcard_constraints:
            converted="|".join(re.escape(path) for path in FILE_CONVERSIONS),
        conda:
            CONDA_ENV
        threads: 1
        resources:
            mem_mb=8000,
            runtime=30,
        params:
            code=code("convert_weights"),
            entry=lambda wc: stable(FILE_CONVERSIONS[wc.converted]),
        script:
            "../scripts/convert_weights.py"


if VLBERT_CONVERSIONS:

    rule convert_vlbert:
        input:
            unpack(lambda wc: conversion_inputs(VLBERT_CONVERSIONS[wc.converted_dir])),
        output:
            model="{converted_dir}/model.safetensors",
            config="{converted_dir}/config.json",
        log:
            "logs/convert/{converted_dir}.log",
        benchmark:
            "benchmarks/rules/convert/{converted_dir}.tsv"
        wildcard_constraints:
            converted_dir="|".join(re.escape(path) for path in VLBERT_CONVERSIONS),
        conda:
            CONDA_ENV
        threads: 1
        resources:
            mem_mb=8000,
            runtime=30,
        params:
            code=code("convert_weights"),
            entry=lambda wc: stable(VLBERT_CONVERSIONS[wc.converted_dir]),
        script:
            "../scripts/convert_weights.py"
