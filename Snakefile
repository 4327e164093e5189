# VL-BERT (Su et al., ICLR 2020) from raw data to the paper's tables.
#
#   uv run snakemake --cores all results/tables/table4_ablation.csv
#
# The default config runs the whole DAG on an embedded synthetic world (CPU, no network).
# Pick another config with --configfile, after the target (it takes one or more files):
#   uv run snakemake --cores all results/tables/table4_ablation.csv --configfile config/ci.yaml

from snakemake.exceptions import WorkflowError
from snakemake.utils import min_version, validate

from vlbert_core.config_schema import check_workflow_config
from vlbert_core.tasks.registry import check_finetune_config, register_config_tasks

min_version("9.0")


configfile: workflow.source_path("config/config.yaml")


# the config files with the one reader (a key given twice is refused) and the merged config against the schema,
# in one line naming the file and key (vlbert_core/config_schema.py); then Snakemake's validate fills the defaults
try:
    check_workflow_config(
        config, [*workflow.configfiles, *workflow.overwrite_configfiles]
    )
except ValueError as err:
    # Snakemake prints a WorkflowError as its message, without a traceback
    raise WorkflowError(str(err)) from None
validate(config, workflow.source_path("config/schema.yaml"))
# one task per tasks.custom entry (your own data, docs/own-data.md), before the task names are used
register_config_tasks(config)
# the task names and what each task needs beyond the schema: the registered tasks decide
check_finetune_config(config["finetune"], config["sources"])


# the helpers (common.smk: the core; the others by concern), then the rules
include: "workflow/rules/common.smk"
include: "workflow/rules/common_data.smk"
include: "workflow/rules/common_tasks.smk"
include: "workflow/rules/common_weights.smk"
include: "workflow/rules/common_seeds.smk"
include: "workflow/rules/common_report.smk"
include: "workflow/rules/world.smk"
include: "workflow/rules/weights.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/rois.smk"
include: "workflow/rules/pretrain.smk"
include: "workflow/rules/finetune.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/tables.smk"
include: "workflow/rules/seeds.smk"
include: "workflow/rules/compare.smk"
include: "workflow/rules/custom.smk"
include: "workflow/rules/report.smk"


onsuccess:
    print_where_results_are()


rule all:
    default_target: True
    input:
        TABLES,
        REPORT,
        CUSTOM_TABLES,
