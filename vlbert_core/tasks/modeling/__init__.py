"""The torch side of each task: its samples (records -> model-ready batches) and its heads on top of
`VLBertModel` outputs. One module per task, so that an edit of one task's samples or head re-runs only
that task's fine-tunes (see vlbert_core/fingerprint.py); what every task's samples share is in
`tasks/samples.py`.

Every head takes the model's `VLBertOutput` and the `VLBertBatch` it came from:
- `vqa.VQAHead`: the `[MASK]` output -> Linear-GELU-LayerNorm-Linear -> one logit per answer; BCE
  on the soft targets, multiplied by the number of answers as in the released code.
- `vcr.VCRHead`: the `[CLS]` output -> Linear -> one score per candidate sequence.
- `vcr.VCRRoIClassifier`: the auxiliary RoI classification with linguistic clues: each `[IMG]`
  output (it has attended to the text) -> Linear -> the box's object-name class.
- `refcoco.RefCOCOHead`: each `[IMG]` output -> MLP -> one binary score per RoI.
- `custom.ClsClassifierHead`: the `[CLS]` output -> Dropout -> Linear -> one logit per label of a
  `tasks.custom` entry; cross-entropy.
- `common`: picking the `[CLS]`, `[MASK]` and `[IMG]` outputs, and the initialisation.
"""

# every task's module: the fine-tune code imports this package, so that its code fingerprint
# covers the samples and heads the task modules reach through `tasks.base.model_side`
from . import custom, refcoco, vcr, vqa  # noqa: F401,E402
