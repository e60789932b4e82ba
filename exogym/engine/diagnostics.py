"""How far the nodes' models have drifted apart (the original's "correlation interval").

Every node calls this together; it moves every node's parameters to every other node, so it is
a measurement (not counted as bytes sent) and is meant to run every few hundred steps.
"""

from __future__ import annotations

import torch

from exogym.comm.transport import Transport

__all__ = ["parameter_divergence"]


@torch.no_grad()
def parameter_divergence(model: torch.nn.Module, comm: Transport) -> dict[str, float]:
    """Mean pairwise Pearson correlation of the nodes' flattened parameters, and their variance across nodes
    (averaged over parameters), over the nodes up at this step. Identical models give correlation 1 and variance 0."""
    flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])  # [P]
    gathered = [torch.empty_like(flat) for _ in range(comm.num_nodes)]
    comm.all_gather(gathered, flat, comm.world)
    stacked = torch.stack([gathered[r] for r in comm.up()]).double()  # [K up, P]
    k = stacked.shape[0]
    variance = stacked.var(dim=0, unbiased=False).mean().item()
    if k < 2:
        return {"param_correlation": 1.0, "param_variance": variance}
    centered = stacked - stacked.mean(dim=1, keepdim=True)
    norms = centered.norm(dim=1).clamp_min(1e-30)
    corr = (centered @ centered.T) / (norms[:, None] * norms[None, :])  # [K, K]
    pairs = corr[torch.triu_indices(k, k, offset=1).unbind()]
    return {"param_correlation": pairs.mean().item(), "param_variance": variance}
