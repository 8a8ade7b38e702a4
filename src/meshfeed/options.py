"""Validation of the arguments every loader front door shares."""

from __future__ import annotations


def check_loader_arguments(
    *,
    batch_size: object,
    seed: object,
    num_workers: object,
    prefetch: object,
    timeout: object,
    on_error: object,
    max_retries: object,
) -> None:
    """Raise ValueError naming the first bad argument and what it must be."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int per data rank (got {batch_size=!r})")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int (got {seed=!r})")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers must be an int >= 0 (got {num_workers=!r})")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
        raise ValueError(f"prefetch must be an int >= 1 (got {prefetch=!r})")
    if not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be positive seconds (got {timeout=!r})")
    if on_error not in ("raise", "skip", "substitute"):
        raise ValueError(f"on_error={on_error!r} is not one of 'raise', 'skip', 'substitute'")
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise ValueError(f"max_retries must be an int >= 0 (got {max_retries=!r})")
