"""Rule `report`: results/report/index.html and its figures (vlbert_core.report)."""

from vlbert_core.report import PLOTS, build_report
from vlbert_core.utils import setup_logging


def main(smk):
    setup_logging(smk.log[0])
    build_report(
        smk.output.html,
        {name: getattr(smk.output, name) for name in PLOTS},
        tables_md=[path for path in smk.input.tables if path.endswith(".md")],
        pretrain_metrics=list(smk.input.pretrain_metrics),
        finetune_metrics=list(smk.input.finetune_metrics),
        shard_stats=list(smk.input.shard_stats),
        roi_parquets=list(smk.input.roi_parquets),
        benchmarks_dir=smk.params.benchmarks_dir,
        config=smk.params.config,
    )


if __name__ == "__main__":  # under Snakemake's script: directive `snakemake` is a global
    from vlbert_core.cli import run_script

    run_script(main, snakemake)  # noqa: F821
