"""Snakemake entry point: convert one published checkpoint (config `convert:`) with `python -m vlbert_core.convert`."""

from pathlib import Path

from vlbert_core.convert.__main__ import main as convert
from vlbert_core.convert.stand_in import set_detector_test_sizes
from vlbert_core.utils import get_logger, setup_compute, setup_logging


def main(smk) -> None:
    setup_logging(smk.log[0])
    setup_compute(smk.threads)
    entry = dict(smk.params.entry)
    out = smk.output.path if "path" in smk.output.keys() else str(Path(smk.output.model).parent)
    argv = [entry["converter"], entry["input"], out]
    for key in ("bert_path", "visual_weights"):
        if entry.get(key):
            argv += ["--" + key.replace("_", "-"), entry[key]]
    get_logger("convert").info("python -m vlbert_core.convert %s", " ".join(argv))
    convert(argv)
    if entry.get("detector_test_sizes"):
        config = set_detector_test_sizes(out, dict(entry["detector_test_sizes"]))
        get_logger("convert").info("%s: test-time sizes set to %s", out, {k: config[k] for k in entry["detector_test_sizes"]})


if __name__ == "__main__":  # under Snakemake's script: directive `snakemake` is a global
    from vlbert_core.cli import run_script

    run_script(main, snakemake)  # noqa: F821
