"""Snakemake entry point: VCR Q->AR accuracy from the Q->A and QA->R prediction files (no torch)."""

from pathlib import Path

from vlbert_core.tasks.vcr import write_q2ar_json
from vlbert_core.utils import setup_logging


def main(smk) -> None:
    setup_logging(smk.log[0])
    write_q2ar_json(
        smk.input.q2a,
        smk.input.qa2r,
        smk.output.json,
        # without a `split` param the eval JSON is named after its split (…/val.json)
        split=getattr(smk.params, "split", None) or Path(smk.output.json).stem,
        setting=smk.params.setting,
        schedule=smk.params.schedule,
        dataset=smk.params.dataset,
    )


if __name__ == "__main__":  # under Snakemake's script: directive `snakemake` is a global
    main(snakemake)  # noqa: F821
