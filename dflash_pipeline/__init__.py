"""dflash-pipeline: offline extraction of target hidden states and DFlash drafter training."""

__version__ = "0.1.0"
