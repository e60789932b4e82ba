"""The original EXO Gym's `exogym.aux` import path, kept so its scripts import unchanged."""
