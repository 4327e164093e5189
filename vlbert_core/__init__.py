"""VL-BERT pipeline library: importable and testable without Snakemake."""
