"""The training engine: one node's loop and what it is built from (run config and plan, the forward/backward,
execution, the model contract, random streams, devices, the global model, nodes coming up, diagnostics)."""
