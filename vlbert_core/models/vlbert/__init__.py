"""VL-BERT (Su et al. 2020): one BERT over the interleaved word and RoI elements, with a visual feature term in its
embeddings (model_type "vlbert" in vlbert_core.models.registry). Outside this package the family is reached through
its registry record only."""
