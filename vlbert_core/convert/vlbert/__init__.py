"""VL-BERT's converter: the authors' checkpoints into model directories (checkpoint.py), the
reference batch and stand-ins that check it against the authors' code (reference.py, authors_runner.py), and its
`python -m vlbert_core.convert` subcommand (command.py)."""
