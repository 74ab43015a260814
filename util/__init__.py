"""Helpers every part of farloco may use and that import no other part: bounded asyncio task handling
(tasks.py), contiguous ranges over a thread pool (parallel.py), the clock the sans-IO protocol code is driven by
(clock.py), large tensors kept out of forked children (memory.py)."""
