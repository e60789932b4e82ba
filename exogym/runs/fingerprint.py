"""A run's fingerprint: everything that shapes its trajectory, so a resume can continue exactly that run or refuse.

Stored in every checkpoint's manifest and compared with the resuming `fit` call before any node starts. What
is in it: the strategy's class and full configuration, the model's class and every parameter and buffer
(name, shape, dtype), the seed, nodes, batch sizes, the data (each node's shard size, steps per epoch,
shuffling, partition), the schedule length (max_steps), failures / elastic pools, the time model, autocast.
What is not: where the run logs, how often it validates or checkpoints, devices and backend (a run may move).
"""

from __future__ import annotations

import json
from typing import Any

import torch

__all__ = ["run_fingerprint", "fingerprint_differences"]

# config.json keys that shape the trajectory (the rest say where and how the run reports)
_TRAJECTORY_KEYS = ("strategy_config", "num_nodes", "max_steps", "steps_per_epoch", "batch_size", "minibatch_size",
                    "shuffle", "seed", "autocast", "partition", "membership", "time_model", "execution")


def run_fingerprint(config: dict[str, Any], model: torch.nn.Module, shard_sizes: list[int]) -> dict[str, Any]:
    """The fingerprint of a run about to start (plain JSON data)."""
    from exogym.runs.loggers import _json_safe  # the same rendering config.json uses
    entries = [[name, list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in model.state_dict().items()]
    out = {k: config[k] for k in _TRAJECTORY_KEYS if k in config}
    if "membership" in out:  # the schedule itself, not the reprs of what built it
        out["membership"] = out["membership"]["schedule"]
    out["model"] = {"class": f"{type(model).__module__}.{type(model).__qualname__}", "state": entries}
    out["shard_sizes"] = list(shard_sizes)
    return json.loads(json.dumps(_json_safe(out), default=repr))


def fingerprint_differences(saved: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    """Every key whose value differs, as (dotted key, saved value, value now); nested dicts are compared entry
    by entry so the message names the exact setting."""
    diffs = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key, "<absent>"), now.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            diffs.extend(fingerprint_differences(a, b, f"{prefix}{key}."))
        elif a != b:
            diffs.append((f"{prefix}{key}", a, b))
    return diffs
