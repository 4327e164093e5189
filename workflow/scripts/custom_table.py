"""Rule `custom_table`: results/tables/custom_<name>.csv (+ .md) from the eval JSONs of its settings."""

from vlbert_core.tables.custom import write_custom_table
from vlbert_core.tasks.custom import CustomSpec
from vlbert_core.utils import setup_logging


def main(smk) -> None:
    setup_logging(smk.log[0])
    spec = CustomSpec.from_config(smk.params.name, dict(smk.params.entry))
    rows = {"train": smk.input.train_rows, "val": smk.input.val_rows}
    write_custom_table(spec, dict(zip(smk.params.settings, smk.input.evals)), smk.input.labels, rows,
                       smk.output.csv, smk.output.md, dataset=smk.params.dataset, model_cfg=dict(smk.params.model))


if __name__ == "__main__":  # under Snakemake's script: directive `snakemake` is a global
    from vlbert_core.cli import run_script

    run_script(main, snakemake)  # noqa: F821
