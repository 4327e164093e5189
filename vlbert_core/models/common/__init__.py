"""What the model families share: the batch and its input sequence, BERT's initialisation, the visual network, the
BERT encoder layer, the outputs task heads read, the model directory, the shared heads and the config base."""
