"""Backends: how nodes start and talk (sim: threads of this process; torch: torch.distributed)."""
