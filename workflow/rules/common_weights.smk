# Helpers: the published weights the workflow makes (weights.smk). The stand-ins of `stand_ins:` and the
# manifests they are written from (package data: vlbert_core/convert/manifests/), the conversions of
# `convert:`, and model.bert_path as a job input when a rule makes it.

import re  # weights.smk: re.escape in the wildcard constraints
from pathlib import Path

import vlbert_core.convert

STAND_INS = config["stand_ins"]
MANIFEST_STAND_INS = {
    path: entry for path, entry in STAND_INS.items() if entry["kind"] == "manifest"
}
BERT_STAND_INS = {
    path: entry for path, entry in STAND_INS.items() if entry["kind"] == "bert"
}
# stand_ins.<path>.manifest names a file here (vlbert_core/convert/manifest.py: MANIFEST_DIR), read
# from the package without importing the converters (torch)
MANIFEST_DIR = Path(vlbert_core.convert.__file__).parent / "manifests"
CONVERSIONS = config["convert"]
FILE_CONVERSIONS = {
    path: entry
    for path, entry in CONVERSIONS.items()
    if entry["converter"] != "vl-bert"
}
VLBERT_CONVERSIONS = {
    path: entry
    for path, entry in CONVERSIONS.items()
    if entry["converter"] == "vl-bert"
}
CONVERSION_FILE_KEYS = (
    "input",
    "bert_path",
    "visual_weights",
)  # entry keys naming files the converter reads


def bert_checkpoint_input():
    """model.bert_path as a job input when rule stand_in_bert makes it (a hand-obtained one is read by the job)."""
    path = config["model"]["bert_path"]
    return [path] if path in BERT_STAND_INS else []


def conversion_inputs(entry):
    return {key: entry[key] for key in CONVERSION_FILE_KEYS if entry.get(key)}
