"""Snakemake entry point: pre-train VL-BERT for one Table 4 setting."""

from pathlib import Path

from vlbert_core.utils import set_threads, setup_logging


def main(smk) -> None:
    setup_logging(smk.log[0])
    set_threads(smk.threads)
    from vlbert_core.pretrain import pretrain

    out_dir = Path(smk.output["model"]).parent
    for name in ("config", "metrics", "visual_clue"):
        if Path(smk.output[name]).parent != out_dir:
            raise ValueError(f"rule pretrain: output '{name}' ({smk.output[name]}) must sit beside {smk.output['model']}")
    pretrain(
        setting=smk.params["setting"],
        cc_shards=list(smk.input["cc_shards"]),
        roi_parquets=list(smk.input["roi_parquets"]),
        text_shards=list(getattr(smk.input, "text_shards", [])),
        detector_path=str(smk.input["detector"]),
        model_cfg=dict(smk.params["model"]),
        pretrain_cfg=dict(smk.params["pretrain"]),
        out_dir=str(out_dir),
        seed=int(smk.params["seed"]),
        device=str(smk.params["device"]),
    )


if __name__ == "__main__":  # under Snakemake's script: directive `snakemake` is a global
    main(snakemake)  # noqa: F821
