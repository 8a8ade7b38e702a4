"""The embedded store's engine: records, plans and rounds, versions and admission, puts and
wake-ups, leases, eviction, columnar storage, dynamic sampling and the fast selection."""
