"""Chi-square goodness of fit, for the sampling-losslessness tests."""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping

import numpy as np


def chi2_critical_999(df: int) -> float:
    """0.999 quantile of chi-square(df), Wilson-Hilferty: df (1 - 2/(9 df) + z sqrt(2/(9 df)))^3."""
    z = 3.0902  # standard normal 0.999 quantile
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(
    counts: Mapping[Hashable, int], probs: Mapping[Hashable, float], n: int
) -> tuple[float, float, int]:
    """(statistic, p=0.001 critical value, df) of `counts` against exact `probs`.

    Cells with expected count < 5 are pooled into one cell, as the test requires.
    """
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for key, p in probs.items():
        if p * n >= 5:
            obs.append(counts.get(key, 0))
            exp.append(p * n)
        elif p > 0:
            pool_o, pool_e = pool_o + counts.get(key, 0), pool_e + p * n
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    o, e = np.array(obs, dtype=float), np.array(exp)
    df = len(o) - 1
    return float(((o - e) ** 2 / e).sum()), chi2_critical_999(df), df
