"""One adapter per training engine; what they share is in ``common``."""

#: Engines HDET runs on (the ``backend`` key of ``hdet-train``, ``hdet-dryrun --backend``).
BACKENDS = ("deepspeed", "fsdp2", "ddp", "fairscale")
