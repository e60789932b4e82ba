"""The earlier name of exogym.strategy.mean (kept so that imports of it keep working)."""

from exogym.strategy.mean import PendingMean, compressed_mean, mean_, start_mean

__all__ = ["PendingMean", "start_mean", "compressed_mean", "mean_"]
