"""Snakemake entry point: download one configured source file, resuming a previous attempt."""

from vlbert_core.data.fetch import FetchSpec, fetch_file
from vlbert_core.utils import setup_logging


def main(smk) -> None:
    setup_logging(smk.log[0])
    spec = FetchSpec.from_config(smk.params.name, dict(smk.params.entry))
    if spec.path != smk.output.path:
        raise ValueError(f"rule fetch: output {smk.output.path} is not fetch.{smk.params.name}.path {spec.path}")
    fetch_file(spec, timeout_s=float(smk.params.timeout_s), attempts=int(smk.params.attempts))


if __name__ == "__main__":  # under Snakemake's script: directive `snakemake` is a global
    from vlbert_core.cli import run_script

    run_script(main, snakemake)  # noqa: F821
