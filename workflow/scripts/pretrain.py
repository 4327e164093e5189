"""Snakemake entry point: pre-train VL-BERT for one Table 4 setting, in this process or through torchrun."""

from pathlib import Path

import yaml

from vlbert_core.pretrain.launch import Launch, distributed_command, pretrain_arguments, run_distributed
from vlbert_core.run_context import RunContext
from vlbert_core.utils import get_logger, setup_compute, setup_logging


def main(smk) -> None:
    setup_logging(smk.log[0])
    out_dir = Path(smk.output["model"]).parent
    for name in ("heads", "config", "metrics", "visual_clue"):
        if Path(smk.output[name]).parent != out_dir:
            raise ValueError(f"rule pretrain: output '{name}' ({smk.output[name]}) must sit beside {smk.output['model']}")
    pretrain_cfg = {k: v for k, v in dict(smk.params["pretrain"]).items() if k != "launch"}
    launch = Launch.from_config(smk.params["pretrain"].get("launch"))
    run = RunContext.from_params(smk.params)  # seed, device, max_image_pixels
    if launch.in_process:
        setup_compute(smk.threads)
        from vlbert_core.models.common.config import ModelSettings
        from vlbert_core.pretrain import pretrain
        from vlbert_core.pretrain.config import PretrainSettings

        pretrain(
            setting=smk.params["setting"],
            cc_shards=list(smk.input["cc_shards"]),
            roi_parquets=list(smk.input["roi_parquets"]),
            text_shards=list(getattr(smk.input, "text_shards", [])),
            detector_path=str(smk.input["detector"]),
            model_cfg=ModelSettings.from_config(dict(smk.params["model"])),
            pretrain_cfg=PretrainSettings.from_config(pretrain_cfg),
            out_dir=str(out_dir),
            seed=run.seed,
            device=run.device,
            init_from=smk.params["init_from"],
            max_image_pixels=run.max_image_pixels,
        )
        return

    # Every process reads the same config: this job's params, written beside the outputs (the run context
    # too; vlbert_core/pretrain/__main__.py reads it back strictly).
    out_dir.mkdir(parents=True, exist_ok=True)
    config_file = out_dir / "launch_config.yaml"
    config_file.write_text(yaml.safe_dump({
        "model": dict(smk.params["model"]), "pretrain": pretrain_cfg, **run.as_dict()}))
    command = distributed_command(launch, pretrain_arguments(
        setting=smk.params["setting"], config_file=str(config_file), cc_shards=list(smk.input["cc_shards"]),
        roi_parquets=list(smk.input["roi_parquets"]), text_shards=list(getattr(smk.input, "text_shards", [])),
        detector=str(smk.input["detector"]), out_dir=str(out_dir), init_from=smk.params["init_from"]))
    log = get_logger("pretrain.launch")
    log.info("%d nodes x %d processes; each rank logs to %s/pretrain.rank<RANK>.log; running: %s",
             launch.nodes, launch.processes_per_node, out_dir, " ".join(command))
    run_distributed(command, smk.log[0], out_dir)


if __name__ == "__main__":  # under Snakemake's script: directive `snakemake` is a global
    from vlbert_core.cli import run_script

    run_script(main, snakemake)  # noqa: F821
