"""Fine-tuning tasks of VL-BERT: VCR (Q->A, QA->R), VQA v2 and RefCOCO+.

Modules:
- `base`: the `Task` class, what every task defines; `registry`: task names -> task classes.
- `vqa`, `vcr`, `refcoco`: one module per task: the loaders of the official files, answer/text
  handling, the official metrics, and the task's `Task` class (torch-free at import, so
  the scoring and the derived-eval jobs can use them without torch).
- `common`: task image loading/resizing and the task RoI parquet reader (torch-free).
- `samples`: what every task's model-ready samples and batches share (torch).
- `modeling`: one module per task with its samples and heads (torch), reached through
  `base.model_side`.
- `finetune`: one training loop for all tasks; `evaluate`: prediction; `scoring`: the metrics.

This package's `__init__` imports nothing heavy on purpose.
"""
