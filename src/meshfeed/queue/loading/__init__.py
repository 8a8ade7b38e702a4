"""StoreLoader: a per-rank iterator over a SampleStore, with its fetches, delivery stage,
errors, versions and elastic resume."""
