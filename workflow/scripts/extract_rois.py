"""Snakemake entry point: detect and select the RoIs of one CC shard."""

from vlbert_core.detector import extract_rois_to_parquet, load_detector, read_cc_shard, selection_kwargs
from vlbert_core.utils import set_threads, setup_logging


def main(smk) -> None:
    setup_logging(smk.log[0])
    set_threads(smk.threads)
    rois = smk.params.rois
    device = getattr(smk.params, "device", "cpu")
    model, _ = load_detector(smk.input.model, map_location=device)
    extract_rois_to_parquet(
        model.to(device),
        read_cc_shard(smk.input.tar),
        smk.output.parquet,
        batch_size=int(rois["batch_size"]),
        select_kwargs=selection_kwargs(rois),
        num_workers=int(rois.get("num_workers", 0)),
    )


if __name__ == "__main__":  # under Snakemake's script: directive `snakemake` is a global
    main(snakemake)  # noqa: F821
