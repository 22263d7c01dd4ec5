"""Many replicas behind an SLO-aware router (`router.py`); simulated by `adaserve simulate
--replicas N --router ...` (adaserve/sim/loop.py)."""
