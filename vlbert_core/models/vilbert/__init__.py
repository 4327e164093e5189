"""ViLBERT (Lu et al. 2019, facebookresearch/vilbert-multi-task): a second model family beside VL-BERT, on the same
visual network, batches and task heads (model_type "vilbert" in vlbert_core.models.registry). Outside this package
the family is reached through its registry record only."""
