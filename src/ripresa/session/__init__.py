"""Training-loop side: the Checkpointer, signal requests, torchrun/distributed helpers."""
