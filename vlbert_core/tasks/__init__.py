"""Fine-tuning tasks of VL-BERT: VCR (Q->A, QA->R), VQA v2 and RefCOCO+.

Modules:
- `common`: task image loading/resizing and the task RoI parquet reader (torch-free).
- `vqa`, `vcr`, `refcoco`: loaders of the official files, answer/text handling and the official
  metrics (torch-free, so `workflow/scripts/vcr_q2ar.py` can use them without torch).
- `samples`: turns loaded records into model-ready samples and batches (torch).
- `heads`: the task heads and their losses.
- `finetune`: one training loop for all tasks; `evaluate`: prediction and official metrics.

This package's `__init__` imports nothing heavy on purpose.
"""

TASKS = ("vcr_q2a", "vcr_qa2r", "vqa", "refcoco")
