"""The Python call that reruns a run, or resumes it, written from its config.json and summary.json.

A run folder does not hold the model or the data (config.json names the model's class and size), so what is shown
is the `fit` call with every setting the run used, to paste where the model and data are made; a sweep's run shows
the sweep's own command, which resumes the whole sweep.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

__all__ = ["rerun_call", "sweep_command"]

# config.json keys that are fit's keywords as they are
_FIT_KEYS = ("max_steps", "batch_size", "minibatch_size", "val_size", "val_interval", "seed", "backend", "execution",
             "processes")
_DEFAULTS = {"batch_size": 16, "val_size": 64, "val_interval": 100, "seed": 42, "backend": "sim",
             "execution": "sequential", "processes": 1}


def _value(v: Any) -> str:
    if isinstance(v, dict) and "optimizer" in v:  # an OptimSpec as config.json writes it
        rest = ", ".join(f"{k}={x!r}" for k, x in v.items() if k != "optimizer")
        return f"OptimSpec(torch.optim.{v['optimizer']}{', ' + rest if rest else ''})"
    return repr(v)


def _strategy(config: Mapping[str, Any]) -> str:
    sc = dict(config.get("strategy_config") or {})
    name = sc.pop("name", config.get("strategy") or "Strategy")
    args = ", ".join(f"{k}={_value(v)}" for k, v in sc.items()
                     if v is not None and (not isinstance(v, dict) or "optimizer" in v))
    return f"{name}({args})"


def _time_model(tm: Mapping[str, Any]) -> list[str]:
    """fit's keywords of the run's time model: the network, the nodes' speeds and throughput, measured or not."""
    kw = [f"network={re.sub(r', [a-z_]+=None', '', tm['network'])}"]  # the arguments left at their default: out
    for key in ("node_speeds", "device_flops"):
        values = tm.get(key) or []
        if values and len(set(values)) == 1:
            values = values[0]  # one number for every node
        if values and values != 1:
            kw.append(f"{key}={values!r}")
    if tm.get("compute_time") == "measured":
        kw.append('compute_time="measured"')
    return kw


def rerun_call(config: Mapping[str, Any], summary: Mapping[str, Any], log_dir: str) -> str:
    """The `fit` call that reruns the run (resumes it, when it was interrupted with a checkpoint).

    Args:
        config: The run's config.json.
        summary: Its summary.json ({} while it runs).
        log_dir: The folder above the run folder (the CSVLogger's log_dir).

    Returns:
        Python source, a few lines.
    """
    kw = [f"strategy={_strategy(config)}", f"num_nodes={config.get('num_nodes', 1)!r}"]
    for key in _FIT_KEYS:
        value = config.get(key)
        if value is None or value == _DEFAULTS.get(key) or (key == "minibatch_size" and value == config["batch_size"]):
            continue  # fit's default (a minibatch of the whole batch is minibatch_size's)
        kw.append(f"{key}={value!r}")
    tm = config.get("time_model") or {}
    if tm.get("network"):
        kw += _time_model(tm)
    name = config.get("run_name")
    kw.append(f"logger=CSVLogger({log_dir!r}, run_name={name!r})")
    resume = summary.get("resume_from")
    if summary.get("status") == "interrupted" and resume:
        kw.append(f"resume_from={resume!r}")
        head = "# resumes the interrupted run from its newest checkpoint (same model and data as it had)"
    else:
        head = "# reruns the run (the earlier folder is kept, moved aside); model and data as the run had: " \
               f"{config.get('model', '?')}, {config.get('parameters', '?')} parameters"
    body = ",\n            ".join(kw)
    imports = ("import torch\nfrom exogym import Trainer\nfrom exogym.strategy import *\n"
               "from exogym.cluster.network import Network\nfrom exogym.runs.loggers import CSVLogger")
    return f"{head}\n{imports}\n\ntrainer = Trainer(model, train_dataset, val_dataset)\ntrainer.fit({body})"


def sweep_command(sweep_folder: str) -> str:
    """The commands that resume a sweep and serve its Optuna dashboard.

    Args:
        sweep_folder: The sweep folder, as the user would type it.

    Returns:
        Two shell lines.
    """
    return f"exogym sweep --resume {sweep_folder}\nexogym sweep dashboard {sweep_folder} --port 8080"
