"""Fused node execution (`fit(execution="fused" | "auto")`): the nodes computing in a step run one batched
forward/backward over their stacked parameters.

stacked.py   where node parameters and buffers live: [K, ...] stacks, node tensors are views of a slot
engine.py    the compute rendezvous's batched step (functional_call under vmap) and the per-node results
attention.py scaled_dot_product_attention with the node dimension folded into the batch (CPU)
layers.py    nn.Linear in the form whose batched weight gradient needs no transposing copy
optim.py     the nodes' SGD / Adam / AdamW steps taken at once, exactly
choose.py    validating "execution" and deciding "auto" (a timed probe on throwaway copies)
"""

from exogym.backends.sim.fused.choose import EXECUTIONS, FusedFallbackWarning

__all__ = ["EXECUTIONS", "FusedFallbackWarning"]
