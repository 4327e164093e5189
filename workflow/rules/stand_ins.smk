# Random-valued stand-ins of published weights (config `stand_ins:`, rehearsal only: config/rehearsal.yaml).
# Each entry's key is the path it writes; the files are laid out as the published ones
# (vlbert_core/convert/stand_in.py), so the converters and loaders downstream run the real path.

import re
from pathlib import Path

STAND_INS = config["stand_ins"]
MANIFEST_STAND_INS = {path: entry for path, entry in STAND_INS.items() if entry["kind"] == "manifest"}
BERT_STAND_INS = {path: entry for path, entry in STAND_INS.items() if entry["kind"] == "bert"}
MANIFEST_DIR = Path(workflow.basedir) / "tests" / "data" / "manifests"


def bert_checkpoint_input():
    """model.bert_path as a job input when rule stand_in_bert makes it (a hand-obtained one is read by the job)."""
    path = config["model"]["bert_path"]
    return [path] if path in BERT_STAND_INS else []


if MANIFEST_STAND_INS:

    rule stand_in:
        input:
            manifest=lambda wc: MANIFEST_DIR / MANIFEST_STAND_INS[wc.stand_in]["manifest"],
        output:
            path="{stand_in}",
        params:
            code=code("stand_in"),
            entry=lambda wc: stable(MANIFEST_STAND_INS[wc.stand_in]),
        log:
            "logs/stand_in/{stand_in}.log",
        benchmark:
            "benchmarks/rules/stand_in/{stand_in}.tsv"
        wildcard_constraints:
            stand_in="|".join(re.escape(path) for path in MANIFEST_STAND_INS),
        threads: 1
        resources:
            mem_mb=4000,
            runtime=10,
        script:
            "../scripts/stand_in.py"


if BERT_STAND_INS:

    rule stand_in_bert:
        output:
            path=directory("{bert_stand_in}"),
        params:
            code=code("stand_in"),
            entry=lambda wc: stable(BERT_STAND_INS[wc.bert_stand_in]),
        log:
            "logs/stand_in/{bert_stand_in}.log",
        benchmark:
            "benchmarks/rules/stand_in/{bert_stand_in}.tsv"
        wildcard_constraints:
            bert_stand_in="|".join(re.escape(path) for path in BERT_STAND_INS),
        threads: 1
        resources:
            mem_mb=4000,
            runtime=10,
        script:
            "../scripts/stand_in.py"
