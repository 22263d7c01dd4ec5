"""Drafters: who proposes candidate trees (a draft model, the suffix index, or both)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from adaserve.request_manager.drafters.base import Drafter, KeepGoing

if TYPE_CHECKING:
    from adaserve.config import SchedulerConfig
    from adaserve.exec.runner import Engine

__all__ = ["Drafter", "KeepGoing", "make_drafter"]


def make_drafter(name: str, cfg: SchedulerConfig, engine: Engine) -> Drafter:
    """The drafter called `name` ("model", "eagle", "suffix", or parts joined by "+")."""
    from adaserve.request_manager.drafters.combined import CombinedDrafter
    from adaserve.request_manager.drafters.eagle import EagleDrafter
    from adaserve.request_manager.drafters.model import ModelDrafter
    from adaserve.request_manager.drafters.suffix import SuffixDrafter

    def build(part: str) -> Drafter:
        if part == "suffix":
            return SuffixDrafter(cfg)
        if part == "model":
            if engine.draft is None or engine.draft_is_head:
                raise ValueError(f"drafter {name!r} needs a draft model (draft_model=DIR)")
            return ModelDrafter(engine.draft, engine.draft_graphs)
        if part == "eagle":
            if not engine.draft_is_head:
                raise ValueError(
                    f"drafter {name!r} needs an EAGLE head (draft_model=HEAD_DIR, "
                    "see docs/eagle.md)"
                )
            return EagleDrafter(engine.draft)  # type: ignore[arg-type]
        raise ValueError(f"unknown drafter {part!r}")

    parts = [build(p) for p in name.split("+")]
    return parts[0] if len(parts) == 1 else CombinedDrafter(parts)
