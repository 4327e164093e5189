"""The torch side of each task: its samples (records -> model-ready batches) and its heads on top of a model's
`EncoderOutput` (vlbert_core/models/common/output.py), whatever its family. One module per task, so that an edit of one
task's samples or head re-runs only that task's fine-tunes (see vlbert_core/fingerprint.py); what every task's
samples share is in `tasks/samples.py`.

Every head is built from the model's `HeadSpec` and takes its `EncoderOutput` and the `ModelBatch` it came from:
- `vqa.VQAHead`: the answer vector (VL-BERT: the `[MASK]` text state; ViLBERT: the pooled h_IMG * h_CLS)
  -> Linear-GELU-LayerNorm-Linear -> one logit per answer; BCE on the soft targets, multiplied by the number
  of answers as in the released code.
- `vcr.VCRHead`: the pooled vector (VL-BERT: `[CLS]`) -> Linear -> one score per candidate sequence.
- `vcr.VCRRoIClassifier`: the auxiliary RoI classification with linguistic clues: each box's visual state
  (it has attended to the text) -> Linear -> the box's object-name class.
- `refcoco.RefCOCOHead`: each box's visual state -> MLP -> one binary score per RoI.
- `custom.ClsClassifierHead`: the pooled vector -> Dropout -> Linear -> one logit per label of a
  `tasks.custom` entry; cross-entropy.
- `retrieval.PairScoreHead`: the pooled vector -> Dropout -> Linear -> one matching score per (caption, image)
  row; ViLBERT's 4-way softmax over each caption's candidates (`retrieval.four_way_loss`).
- `common`: where a head reads its vector, and the head layouts.
"""

# every task's module: the fine-tune code imports this package, so that its code fingerprint
# covers the samples and heads the task modules reach through `tasks.base.model_side`
from . import custom, refcoco, retrieval, vcr, vqa  # noqa: F401,E402
