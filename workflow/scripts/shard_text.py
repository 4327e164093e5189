"""Snakemake entry point: one text corpus (books or wiki) → document shards + accounting."""

from collections.abc import Mapping

from vlbert_core.data import shard_text_corpus
from vlbert_core.utils import setup_logging


def main(smk) -> None:
    setup_logging(smk.log[0])
    corpus = smk.params.corpus
    num_shards = smk.params.num_shards
    if isinstance(num_shards, Mapping):  # text.num_shards may be given per corpus
        num_shards = num_shards[corpus]
    tars = list(smk.output.tars)
    if len(tars) != int(num_shards):
        raise ValueError(f"rule shard_text for {corpus}: {len(tars)} output tars but params.num_shards={num_shards}")
    shard_text_corpus(
        corpus,
        smk.input.source,
        tars,
        smk.output.accounting,
        sentences_per_doc=int(smk.params.sentences_per_doc),
        processes=int(smk.threads),
    )


if __name__ == "__main__":  # under Snakemake's script: directive `snakemake` is a global
    from vlbert_core.cli import run_script

    run_script(main, snakemake)  # noqa: F821
