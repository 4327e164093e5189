"""Snakemake entry point: write one random-valued stand-in of a published checkpoint (config `stand_ins:`)."""

from vlbert_core.convert.stand_in import write_bert_stand_in, write_manifest_stand_in
from vlbert_core.utils import get_logger, setup_compute, setup_logging


def main(smk) -> None:
    setup_logging(smk.log[0])
    setup_compute(smk.threads)
    entry = dict(smk.params.entry)
    out = smk.output.path
    if entry["kind"] == "bert":
        write_bert_stand_in(out, seed=int(entry.get("seed", 0)), bert_layers=entry.get("bert_layers"))
    else:
        manifest = write_manifest_stand_in(smk.input.manifest, out, seed=int(entry.get("seed", 0)),
                                           bert_layers=entry.get("bert_layers"))
        get_logger("stand_in").info("%s: stand-in of %s, %d tensors", out, manifest.file, len(manifest.tensors))


if __name__ == "__main__":  # under Snakemake's script: directive `snakemake` is a global
    from vlbert_core.cli import run_script

    run_script(main, snakemake)  # noqa: F821
