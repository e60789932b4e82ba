"""Data: per-node sharding and loaders for real data sets."""
