"""Ready-made models that follow the exogym contract: model(batch) returns the loss (and metrics)."""

from exogym.models.cnn import ExoGymMnistCNN, FedAvgCNN, MnistCNN
from exogym.models.gpt import GPT
from exogym.models.mlp import MLPClassifier

__all__ = ["MnistCNN", "ExoGymMnistCNN", "FedAvgCNN", "MLPClassifier", "GPT"]
