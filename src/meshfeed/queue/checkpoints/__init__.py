"""A store's checkpoint: its state as a versioned plain dict, atomic files, and the checks of
its bookkeeping before a store is rebuilt from it."""
