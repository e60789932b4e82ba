"""The simulated cluster: the network model, simulated time, and which nodes are up (failures, elastic pools)."""
