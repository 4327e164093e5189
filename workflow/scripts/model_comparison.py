"""Rule `model_comparison`: VL-BERT vs ViLBERT over seeds, CSV + Markdown, and their retrieval table."""

from pathlib import Path

from vlbert_core.tables.comparison import write_comparison_table
from vlbert_core.tables.retrieval import write_retrieval_table
from vlbert_core.utils import setup_logging


def main(smk):
    setup_logging(smk.log[0])
    tables_dir = Path(smk.output.csv).parent  # results/tables/
    write_comparison_table(tables_dir.parent, tables_dir, smk.params.seeds, smk.params.default_seed,
                           smk.params.dataset)
    write_retrieval_table(tables_dir.parent, tables_dir, smk.params.seeds, smk.params.default_seed,
                          smk.params.dataset)


if __name__ == "__main__":  # under Snakemake's script: directive `snakemake` is a global
    from vlbert_core.cli import run_script

    run_script(main, snakemake)  # noqa: F821
