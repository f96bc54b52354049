"""hdet_scale: Hyperparameter-Divergent Ensemble Training (HDET, arXiv 2604.24708) for
DeepSpeed ZeRO-3 and PyTorch FSDP2."""

__version__ = "0.1.0"
