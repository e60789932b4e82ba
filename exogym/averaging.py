"""The earlier name of exogym.global_model (kept so that imports of it keep working)."""

from exogym.global_model import global_state_dict, mean_over

__all__ = ["global_state_dict", "mean_over"]
