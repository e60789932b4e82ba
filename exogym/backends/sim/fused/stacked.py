"""Where fused nodes keep their parameters: one stacked [K, ...] tensor per parameter and buffer.

Node r's module tensors are views of slot r (`p.data` is `stack[r]`), so its optimizer, its
strategy, the comm layer and checkpoints keep seeing ordinary per-node objects, and everything
they do in place (`p.add_`, `p.copy_`, `load_state_dict`, an all-reduce into `p.data`) lands in
the stack. Views survive only in-place writes: code that rebinds `p.data`, assigns a new buffer or
moves the module leaves that node's tensors outside the stack. `sync` is therefore run for every
node before each batched step: a tensor that is not its slot's view has its value copied into the
slot and is made a view again, so the node's own objects always hold the truth.

This is the only module that knows the storage layout; a later "state kept once" can alias
identical slots here without the engine or the strategies noticing.
"""

from __future__ import annotations

import torch

__all__ = ["NodeStacks"]


class NodeStacks:
    """The stacked parameters and buffers of `num_nodes` copies of `template`, and node r's views into slot
    r - first (`first`: the first node of this process's block, when a run spans several processes)."""

    def __init__(self, template: torch.nn.Module, num_nodes: int, device: torch.device, first: int = 0):
        self.num_nodes, self.device, self.first = num_nodes, device, first
        # named_parameters() lists a tied tensor once; functional_call re-ties it by module identity.
        self.param_shapes = {n: (p.shape, p.dtype) for n, p in template.named_parameters()}
        self.buffer_shapes = {n: (b.shape, b.dtype) for n, b in template.named_buffers()}
        self.trainable = {n: p.requires_grad for n, p in template.named_parameters()}
        self.params = {n: torch.zeros((num_nodes, *s), dtype=d, device=device)
                       for n, (s, d) in self.param_shapes.items()}
        self.buffers = {n: torch.zeros((num_nodes, *s), dtype=d, device=device)
                        for n, (s, d) in self.buffer_shapes.items()}
        self._slots = {n: list(t.unbind(0)) for n, t in (*self.params.items(), *self.buffers.items())}
        self._homes: dict[int, tuple[torch.nn.Module, list, list]] = {}  # rank -> (model, params', buffers' homes)

    def _where(self, rank: int, model: torch.nn.Module) -> tuple[list, list]:
        """(name, owning module, attribute) of every parameter and buffer, resolved once per node model:
        reading module._parameters[attr] each step still sees a parameter the module replaced."""
        home = self._homes.get(rank)
        if home is None or home[0] is not model:
            params = [(n, *_owner(model, n)) for n in self.param_shapes]
            buffers = [(n, *_owner(model, n)) for n in self.buffer_shapes]
            home = self._homes[rank] = (model, params, buffers)
        return home[1], home[2]

    def sync(self, rank: int, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Make node `rank`'s parameters and buffers views of slot `rank` (copying in any value that lives
        elsewhere); return its parameters by name."""
        param_homes, buffer_homes = self._where(rank, model)
        params = {n: m._parameters.get(a) for n, m, a in param_homes}
        buffers = {n: m._buffers.get(a) for n, m, a in buffer_homes}
        missing = [n for n, t in (*params.items(), *buffers.items()) if t is None]
        if missing:
            raise RuntimeError(f"node {rank}'s model no longer has {missing}; execution='fused' needs every "
                               "node's model to keep its parameters and buffers: use execution='sequential'")
        for name, t in (*params.items(), *buffers.items()):
            slot = self._slots[name][rank - self.first]
            if t.data_ptr() != slot.data_ptr() or t.shape != slot.shape or t.stride() != slot.stride():
                if t.shape != slot.shape or t.dtype != slot.dtype or t.device != slot.device:
                    raise RuntimeError(f"node {rank}'s tensor {name!r} is {tuple(t.shape)} {t.dtype} on {t.device}, "
                                       f"not {tuple(slot.shape)} {slot.dtype} on {slot.device} as at the start; "
                                       "execution='fused' needs fixed shapes, dtypes and one device: use "
                                       "execution='sequential'")
                with torch.no_grad():
                    slot.copy_(t)
                t.data = slot
        return params

    def release(self, rank: int, model: torch.nn.Module) -> None:
        """Give node `rank`'s tensors storage of their own (before pickling: a view would pickle the whole
        stack); `sync` takes them back at the node's next batched step."""
        for t in (*model.parameters(), *model.buffers()):
            if t.untyped_storage().nbytes() > t.numel() * t.element_size():
                t.data = t.data.clone()

    def gather(self, members: list[int]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], bool]:
        """The members' slots [M, ...] of every parameter and buffer, and whether they are copies (whose
        updated buffers must be written back with `scatter_buffers`) rather than views."""
        members = [m - self.first for m in members]
        lo = members[0]
        if members == list(range(lo, lo + len(members))):  # a run of ranks: views, no copy
            sl = slice(lo, lo + len(members))
            return ({n: t[sl] for n, t in self.params.items()}, {n: t[sl] for n, t in self.buffers.items()}, False)
        idx = torch.tensor(members, device=self.device)
        return ({n: t.index_select(0, idx) for n, t in self.params.items()},
                {n: t.index_select(0, idx) for n, t in self.buffers.items()}, True)

    def scatter_buffers(self, members: list[int], buffers: dict[str, torch.Tensor]) -> None:
        idx = torch.tensor([m - self.first for m in members], device=self.device)
        for n, t in buffers.items():
            self.buffers[n].index_copy_(0, idx, t)


def _owner(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    """The submodule holding tensor `name` ("blocks.0.attn.qkv.weight") and its attribute there."""
    path, _, attr = name.rpartition(".")
    try:
        return (model.get_submodule(path) if path else model), attr
    except AttributeError as e:
        raise RuntimeError(f"a node's model has no {name!r} (its structure differs from the model given to "
                           "Trainer); execution='fused' needs every node's model to have the same structure") from e
