"""Caption-based image retrieval on Flickr30k, VL-BERT vs ViLBERT: `results/tables/retrieval.csv` (+ .md).

The settings of the model comparison (vlbert_core/tables/comparison.py), each over the seeds of `compare.seeds`:
R@1/5/10 of the model fine-tuned on the task (ViLBERT's 4-way training, Table 4's schedule), and R@1/5/10 of the
pre-trained model with its image-caption alignment head alone (zero-shot, rule `zero_shot_retrieval`), for the
settings that train such a head. Under them, the ViLBERT paper's numbers (Lu et al. 2019, Table 1, Flickr30k
image retrieval: the fine-tuned ViLBERT row and its zero-shot row).
"""

from __future__ import annotations

from pathlib import Path

from vlbert_core.models.registry import family
from vlbert_core.pretrain.settings import get_setting
from vlbert_core.stats import mean_std
from vlbert_core.utils import get_logger

from .build import eval_json_path, read_eval, table_specs, write_csv_and_markdown, ABLATION_TABLE
from .comparison import check_comparison_seeds, comparison_settings, zero_shot_settings
from .seeds import seed_results_dir

log = get_logger(__name__)

RETRIEVAL_TABLE = "retrieval"
EVAL_TASK, SPLIT = "retrieval", "test"
RECALLS = (("r1", "value"), ("r5", "recall_at_5"), ("r10", "recall_at_10"))  # column, eval JSON key
# Lu et al. 2019 (ViLBERT, NeurIPS), Table 1, "Image Retrieval" on Flickr30k's 1,000 test images: ViLBERT
# fine-tuned, and ViLBERT zero-shot (the pre-trained alignment head alone). R@1 58.2 is also what public benchmark
# listings give for the paper.
PAPER = {"ViLBERT (Lu et al. 2019), fine-tuned": (58.20, 84.90, 91.52),
         "ViLBERT (Lu et al. 2019), zero-shot": (31.86, 61.12, 72.80)}


def zero_shot_eval_path(results_dir: Path, setting: str, split: str = SPLIT) -> Path:
    """The eval JSON of a pre-trained model's zero-shot retrieval (rule zero_shot_retrieval)."""
    return Path(results_dir) / "zero_shot" / EVAL_TASK / setting / f"{split}.json"


def retrieval_eval_paths(results_dir: str | Path, seeds: list[int], default_seed: int) -> list[Path]:
    """Every eval JSON the retrieval table reads: fine-tuned for every setting, zero-shot for those with a head."""
    schedule = table_specs()[ABLATION_TABLE].schedule
    paths = []
    for seed in seeds:
        root = seed_results_dir(results_dir, seed, default_seed)
        paths += [eval_json_path(root, EVAL_TASK, s, schedule, SPLIT) for s in comparison_settings()]
        paths += [zero_shot_eval_path(root, s) for s in zero_shot_settings()]
    return paths


def _cells(paths: list[Path], prefix: str) -> dict:
    records = [read_eval(path) for path in paths]
    row = {}
    for name, key in RECALLS:
        try:
            values = [float(r[key]) for r in records]
        except KeyError:
            raise ValueError(f"retrieval eval JSONs {[str(p) for p in paths]}: no {key!r}") from None
        cell = mean_std(values)
        row.update({f"{prefix}_{name}_mean": cell.mean, f"{prefix}_{name}_std": cell.std,
                    f"{prefix}_{name}_values": " ".join(repr(v) for v in values)})
    return row


def retrieval_rows(results_dir: str | Path, seeds: list[int], default_seed: int) -> list[dict]:
    check_comparison_seeds(seeds)
    schedule = table_specs()[ABLATION_TABLE].schedule
    roots = [seed_results_dir(results_dir, seed, default_seed) for seed in seeds]
    rows = []
    for setting in comparison_settings():
        row = {"setting": setting, "family": family(get_setting(setting).model_type).display_name,
               "seeds": " ".join(map(str, seeds)),
               **_cells([eval_json_path(r, EVAL_TASK, setting, schedule, SPLIT) for r in roots], "finetuned")}
        if setting in zero_shot_settings():
            row.update(_cells([zero_shot_eval_path(r, setting) for r in roots], "zero_shot"))
        rows.append(row)
    if rows:
        rows.append(chance_row(eval_json_path(roots[0], EVAL_TASK, comparison_settings()[0], schedule, SPLIT)))
    return rows


CHANCE_SETTING = "chance"


def chance_row(eval_path: Path) -> dict:
    """What ranking the split's images at random scores: R@K = K / N (the eval JSON's `baseline` is R@1's)."""
    record = read_eval(eval_path)
    if record.get("baseline") is None:
        raise ValueError(f"eval JSON {eval_path} has no 'baseline' (1 / the split's images): it was written before "
                         "the baselines; re-run its evaluate job")
    row = {"setting": CHANCE_SETTING, "family": "baseline (no model)", "seeds": ""}
    for prefix in ("finetuned", "zero_shot"):
        for (name, _), k in zip(RECALLS, (1, 5, 10)):
            row.update({f"{prefix}_{name}_mean": min(100.0, k * float(record["baseline"])),
                        f"{prefix}_{name}_std": 0.0, f"{prefix}_{name}_values": ""})
    return row


def retrieval_header() -> list[str]:
    header = ["setting", "family", "seeds"]
    for prefix in ("finetuned", "zero_shot"):
        for name, _ in RECALLS:
            header += [f"{prefix}_{name}_{part}" for part in ("mean", "std", "values")]
    return header


def retrieval_markdown(rows: list[dict], dataset: str) -> str:
    lines = ["# Caption-based image retrieval (Flickr30k format): VL-BERT vs ViLBERT (%)", "",
             "| model | setting | fine-tuned R@1 | R@5 | R@10 | zero-shot R@1 | R@5 | R@10 |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        cells = [row["family"], row["setting"]]
        for prefix in ("finetuned", "zero_shot"):
            for name, _ in RECALLS:
                key = f"{prefix}_{name}_mean"
                if key not in row:
                    cells.append("–")
                elif row["setting"] == CHANCE_SETTING:
                    cells.append(f"{row[key]:.1f}")
                else:
                    cells.append(f"{row[key]:.1f} ± {row[f'{prefix}_{name}_std']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    for model, numbers in PAPER.items():
        zero_shot = model.endswith("zero-shot")
        blank = ["–"] * 3
        shown = [f"{v:.2f}" for v in numbers]
        lines.append("| " + " | ".join([f"{model}, reported", "", *(blank + shown if zero_shot else shown + blank)])
                     + " |")
    seeds = rows[0]["seeds"] if rows else ""
    lines.append("")
    lines.append(f"The `{CHANCE_SETTING}` row ranks the images at random: R@K = K / the split's images.")
    lines += ["", f"Measured on the **{dataset}** data, seeds {seeds}: mean ± sample standard deviation. Each test "
              "caption is scored against every test image and the recall is the share of captions whose image "
              "ranks in the top K. Fine-tuned: ViLBERT's 4-way training (the true pair, a random caption, a random "
              "image, a hard-negative image), Table 4's schedule. Zero-shot: the pre-trained model's image-caption "
              "head alone (VL-BERT's sentence-image relationship head on `[CLS]`, ViLBERT's alignment head on "
              "h_IMG × h_CLS), for the settings that train one. The reported rows are Lu et al. 2019, Table 1 "
              "(Flickr30k, 1,000 test images)."]
    return "\n".join(lines) + "\n"


def write_retrieval_table(results_dir: str | Path, tables_dir: str | Path, seeds: list[int], default_seed: int,
                          dataset: str) -> Path:
    rows = retrieval_rows(results_dir, seeds, default_seed)
    csv_path = Path(tables_dir) / f"{RETRIEVAL_TABLE}.csv"
    write_csv_and_markdown(rows, retrieval_header(), csv_path, retrieval_markdown(rows, dataset))
    log.info("wrote %s (%d settings x %d seeds)", csv_path, len(rows), len(seeds))
    return csv_path
