"""
A floor under SC-GRPO's token weight, the shortest fork of scgrpo.py (variants/README.md shows it):
every token the teacher scores keeps at least --weight-floor of its clipped term,
    w = floor + (1 - floor) f(D),
put on after Eq. (5), so the solve-none scores s_i stay the paper's mean f(D). Not the paper's: an
example of a fork of one seam, the credit.
    python variants/weight_floor.py --weight-floor 0.1
"""
import os
import sys
from dataclasses import dataclass, replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scgrpo.py
import scgrpo as S  # noqa: E402


@dataclass
class Config(S.Config):
    """scgrpo.py's settings, and the floor."""
    algo: str = S.setting("weight-floor", "SC-GRPO, f(D) floored", ("weight-floor",))
    weight_floor: float = S.setting(0.1, "the least weight of a token the teacher scores",
                                    rule=(lambda v, cfg: 0 <= v <= 1, "in [0, 1]"))


def floored_credit(model, cfg, ro, batch):
    """The credit seam: SC-GRPO's (D, f(D), then Eq. 5), then the floor on the active tokens of
    every answer the teacher scored; the other answers keep weight 1."""
    batch, metrics = S.sc_credit(model, cfg, ro, batch)
    rows, floor = batch.scored, cfg.weight_floor
    w = (floor + (1 - floor) * batch.weights[rows]) * batch.active[rows]         # (R, L)
    return replace(batch, weights=batch.weights.index_put((rows,), w)), metrics


def main(argv=None):
    """scgrpo.py's command line with this file's settings and credit."""
    S.main(argv, Config=Config, credit=floored_credit)


if __name__ == "__main__":
    main()
