"""ViLBERT's converter: the authors' pretrained_model.bin into a model directory (checkpoint.py), the
reference check against the authors' code (reference.py, authors_runner.py), and its `python -m
vlbert_core.convert` subcommand (command.py)."""
