"""The model contract: how a node calls the model on a batch, and how it reads the loss from what comes back.

Calling: `model(batch)`; but when the batch is a dict and every key names a parameter of the model's
forward (a Hugging Face model: `forward(input_ids=..., attention_mask=..., labels=...)`), the entries
are passed as keywords, `model(**batch)`.

Reading the output: a scalar loss tensor; or anything holding a loss, a dict with "loss" or an object
with a `.loss` attribute (a `transformers` ModelOutput is both). Its other scalar entries or fields
(numbers or one-element tensors) are recorded as metrics; the rest (logits, caches, None) is ignored.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Callable

import torch

__all__ = ["CONTRACT", "WRAPPER_EXAMPLE", "model_caller", "parse_model_output"]

CONTRACT = 'model(batch) must return a scalar loss tensor, or a dict (or an object) holding "loss"'
WRAPPER_EXAMPLE = (
    "wrap a model that returns logits, e.g.\n"
    "    class WithLoss(torch.nn.Module):\n"
    "        def __init__(self, net): super().__init__(); self.net = net\n"
    "        def forward(self, batch): x, y = batch; return torch.nn.functional.cross_entropy(self.net(x), y)\n"
    "and pass WithLoss(net) to Trainer")


def _forward_names(model: torch.nn.Module) -> set[str]:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a builtin or C-implemented forward: nothing to read
        return set()
    return {name for name, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def takes_keyword_batch(model: torch.nn.Module, batch: Any) -> bool:
    """True when `batch` is a dict whose every key is a named parameter of model.forward (call model(**batch))."""
    if not isinstance(batch, Mapping) or not batch or not all(isinstance(k, str) for k in batch):
        return False
    return set(batch) <= _forward_names(model)


def model_caller(model: torch.nn.Module, batch: Any) -> Callable[[torch.nn.Module, Any], Any]:
    """How to call models of this kind on batches of this kind, decided once from the first batch."""
    if takes_keyword_batch(model, batch):
        return lambda m, b: m(**b)
    names = _forward_names(model)
    if isinstance(batch, Mapping) and len(names) > 1 and names & set(batch):
        # Some keys are the forward's keywords and some are not: a column left in the data (text, ids).
        extra = sorted(set(batch) - names)
        raise TypeError(f"the batch has keys {sorted(batch)}; {type(model).__name__}.forward takes some of them as "
                        f"keywords but not {extra}; drop those columns from the dataset (for a "
                        f"datasets.Dataset: .remove_columns({extra})) so the batch can be passed as model(**batch)")
    return lambda m, b: m(b)


def contract_error(batch: Any, cause: BaseException) -> TypeError:
    """The error for a model that could not take the batch at all (a plain classifier given (inputs, labels))."""
    kind = type(batch).__name__
    return TypeError(f"calling the model on the first batch (a {kind}) failed: {type(cause).__name__}: {cause}\n"
                     f"The model contract: Trainer calls model(batch) with the whole batch, e.g. the (inputs, labels) "
                     f"tuple of a TensorDataset; {CONTRACT}; {WRAPPER_EXAMPLE}")


def _scalar(value: Any) -> torch.Tensor | None:
    """value as a float scalar tensor, or None when it is not a scalar (logits, caches, None, strings)."""
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(()).float() if value.numel() == 1 else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value))
    return None


def _fields(out: Any) -> dict[str, Any] | None:
    """The named parts of an output holding a loss (a mapping, or an object's attributes), else None."""
    if isinstance(out, torch.Tensor):  # the loss itself: the common case, decided first
        return None
    if isinstance(out, Mapping):
        return dict(out) if "loss" in out else None
    if isinstance(out, tuple) and hasattr(out, "_asdict"):  # a namedtuple
        fields = out._asdict()
        return fields if "loss" in fields else None
    if not isinstance(out, (torch.Tensor, tuple, list)) and hasattr(out, "loss"):
        attrs = getattr(out, "__dict__", {})
        return {k: v for k, v in attrs.items() if not k.startswith("_")} | {"loss": out.loss}
    return None


def parse_model_output(out: Any, *, training: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Split what the model returned into the loss (a scalar tensor) and extra scalar metrics, or raise a
    TypeError that states the contract. training=False (evaluation) does not require the loss to have a grad."""
    if type(out) is torch.Tensor and out.dim() == 0 and out.is_floating_point() and (out.requires_grad or not training):
        return out, {}  # the common case: the scalar loss itself, as the checks below would return it
    fields = _fields(out)
    if fields is None and isinstance(out, Mapping):
        raise TypeError(f"model(batch) returned a dict without a 'loss' entry (keys: {sorted(map(str, out))}); "
                        f"{CONTRACT}: return the scalar loss under 'loss'")
    metrics: dict[str, torch.Tensor] = {}
    if fields is not None:
        for name, value in fields.items():
            scalar = _scalar(value) if name != "loss" else None
            if scalar is not None:
                metrics[name] = scalar
        out = fields["loss"]
    if isinstance(out, torch.Tensor) and out.numel() > 1:
        raise TypeError(f"model(batch) returned a tensor of shape {tuple(out.shape)}, not a loss (logits?). "
                        f"{CONTRACT}; {WRAPPER_EXAMPLE}")
    if not isinstance(out, torch.Tensor) or out.numel() != 1 or not out.is_floating_point():
        shape = f" of shape {tuple(out.shape)} and dtype {out.dtype}" if isinstance(out, torch.Tensor) else ""
        raise TypeError(f"{CONTRACT}; got {type(out).__name__}{shape}. If the model returns logits, "
                        f"{WRAPPER_EXAMPLE}")
    if training and not out.requires_grad:
        raise TypeError("the loss returned by model(batch) does not require grad; compute it from the model's "
                        "parameters, outside torch.no_grad()")
    return (out if out.dim() == 0 else out.reshape(())), metrics  # reshape costs a dispatch, even as a no-op
