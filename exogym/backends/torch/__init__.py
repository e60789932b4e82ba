"""The torch backend: every node is an OS process, collectives are torch.distributed calls."""
