"""Where a store lives: the Backend contract, this process (embedded), or a Ray actor with its
data plane."""
