"""Ready-made models that follow the exogym contract: model(batch) returns the loss (and metrics)."""

from exogym.models.cnn import MnistCNN

__all__ = ["MnistCNN"]
