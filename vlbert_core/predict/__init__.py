"""Ask a fine-tuned model about your own images: `python -m vlbert_core.predict` (docs/predict.md)
and the `Predictor` API behind it."""

from .api import PredictError, Predictor, draw_box, read_model_task

__all__ = ["PredictError", "Predictor", "draw_box", "read_model_task"]
