"""Rule `tables`: Tables 1–4 as CSV + Markdown from the eval JSONs."""

from pathlib import Path

from vlbert_core.tables import write_tables
from vlbert_core.utils import setup_logging


def main(smk):
    setup_logging(smk.log[0])
    tables_dir = Path(smk.output[0]).parent
    # inputs are results/eval/{task}/{setting}/{schedule}/{split}.json
    results_dir = Path(smk.input[0]).parents[4]
    write_tables(results_dir, tables_dir, smk.params.settings, smk.params.dataset, smk.params.model,
                 released_from=smk.params.released_from)


if __name__ == "__main__":  # under Snakemake's script: directive `snakemake` is a global
    from vlbert_core.cli import run_script

    run_script(main, snakemake)  # noqa: F821
