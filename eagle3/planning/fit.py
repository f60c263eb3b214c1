"""Size a run to this host: where the plan (this host's measured speed included) is longer than the run's
`fit_minutes`, fewer conversations (`prepare.limit`) until it fits.

Why the data and not the epochs or the eval: the eval's questions are the measurement, and extraction costs more per
token than a later training pass, so cutting conversations saves the most time per unit of training lost. The
plan's time grows with the conversations (extraction per token; training per token until train.max_steps ends it;
the probe, the replay set and the eval not at all), so the limit is the largest multiple of `STEP` whose plan fits,
found by bisection (at least `FLOOR`). Fewer conversations, not more passes over them: the trainer's max_steps
overrides its epochs, so a max_steps set for the configured data would run the cut data for more passes than
`epochs` and cost as much as before; where `epochs` passes over a candidate's data end before it, the candidate
trains those passes (max_steps dropped), as its plan says. The choice is written to run_dir/fit.json on the first
run and read back by every rerun of that dir, so a resumed run keeps its prepared data instead of re-probing into a
slightly different limit and redoing the stages.
"""
from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3.config import PipelineConfig
from eagle3.planning.estimates import expected_conversations
from eagle3.probe import HostSpeed
from eagle3.runtime.progress import hms
from eagle3.storage.atomic import atomic_write_json

FIT_FILE = "fit.json"
STEP = 25     # conversations: coarse, so hosts of one kind pick the same limit
FLOOR = 50    # fewer and the draft's vocabulary and validation split are too thin to mean anything


@dataclass(frozen=True)
class Fit:
    """What fitting chose: the configured and the chosen prepare.limit, the plan's seconds at each, the budget."""

    budget_s: float
    limit: int
    planned_s: float
    fitted_limit: int
    fitted_s: float
    max_steps_dropped: bool = False  # train.max_steps dropped: `epochs` passes over the fitted data end first

    @property
    def cut(self) -> bool:
        return self.fitted_limit < self.limit

    def line(self) -> str:
        if not self.cut:
            return (f"fit: the plan ({hms(self.planned_s)}) is within fit_minutes ({hms(self.budget_s)}): "
                    f"{self.limit} conversations, as configured")
        over = "" if self.fitted_s <= self.budget_s else f" (the floor, {FLOOR}: still over the budget)"
        steps = "; train.max_steps dropped: its epochs over them end first" if self.max_steps_dropped else ""
        return (f"fit: this host plans {self.limit} conversations at {hms(self.planned_s)}, over fit_minutes "
                f"({hms(self.budget_s)}): prepare.limit {self.limit} -> {self.fitted_limit}{over}{steps}, planned "
                f"{hms(self.fitted_s)}")


def fit(cfg: PipelineConfig, host: HostSpeed, keep: bool = True) -> tuple[PipelineConfig, Fit | None]:
    """`cfg` with prepare.limit cut to fit cfg.fit_minutes on a host of speed `host`, and what was chosen; `cfg`
    and None where fit_minutes is 0. An earlier choice in run_dir/fit.json is kept; `keep` False (a dry run) writes
    none."""
    if not cfg.fit_minutes:
        return cfg, None
    if (f := read_fit(cfg.run_dir)) is not None:
        return _applied(cfg, f), f
    f = _choose(cfg, host)
    if keep:
        atomic_write_json(Path(cfg.run_dir) / FIT_FILE, asdict(f))
    return _applied(cfg, f), f


def read_fit(run_dir: str | Path) -> Fit | None:
    """The choice an earlier run of this dir made (run_dir/fit.json), or None."""
    path = Path(run_dir) / FIT_FILE
    return Fit(**json.loads(path.read_text())) if path.is_file() else None


def _choose(cfg: PipelineConfig, host: HostSpeed) -> Fit:
    budget = cfg.fit_minutes * 60
    limit = expected_conversations(cfg)
    full = _plan_s(cfg, host)
    if full <= budget or limit <= FLOOR:
        return Fit(budget, limit, full, limit, full)
    # the plan's time grows with the conversations, but not on one line: where train.max_steps ends training, more
    # conversations add extraction only. So bisect the limits the fit may choose for the largest within the budget.
    cands = range(FLOOR, limit, STEP)
    candidate = functools.cache(lambda n: _candidate(cfg, n))
    seconds = functools.cache(lambda n: _plan_s(candidate(n), host))  # the chosen limit's plan was made while bisecting
    lo, hi = 0, len(cands)  # -> lo: how many candidates fit (a prefix, as the time only grows)
    while lo < hi:
        mid = (lo + hi) // 2
        if seconds(cands[mid]) <= budget:
            lo = mid + 1
        else:
            hi = mid
    n = cands[max(lo - 1, 0)]
    return Fit(budget, limit, full, n, seconds(n), candidate(n).train.max_steps != cfg.train.max_steps)


def _plan_s(cfg: PipelineConfig, host: HostSpeed) -> float:
    from eagle3.planning import plan

    return plan(cfg, free_bytes=1 << 60, free_mem=1 << 60, host=host).total_seconds()


def _candidate(cfg: PipelineConfig, limit: int) -> PipelineConfig:
    """`cfg` at `limit` conversations, without train.max_steps where `epochs` passes over them end before it (see the
    module docstring). Decided once, from the estimates, and kept in fit.json: once prepare has run, the
    estimates read its counts, and a rerun must not train another length."""
    from eagle3.planning.estimates import estimated_steps_per_epoch, expected_tokens

    c, tc = _with_limit(cfg, limit, False), cfg.train
    ends_first = bool(tc.max_steps) and tc.epochs * estimated_steps_per_epoch(c, expected_tokens(c)) < tc.max_steps
    return _with_limit(cfg, limit, True) if ends_first else c


def _applied(cfg: PipelineConfig, f: Fit) -> PipelineConfig:
    """`cfg` as the stages run it: its limit (and max_steps) cut where the fit cut it, else untouched (an unset
    limit stays unset: where the source's record count is only estimated, from its size, setting it would drop
    records)."""
    return _with_limit(cfg, f.fitted_limit, f.max_steps_dropped) if f.cut else cfg


def _with_limit(cfg: PipelineConfig, limit: int, drop_max_steps: bool) -> PipelineConfig:
    update = {"prepare": cfg.prepare.model_copy(update={"limit": limit})}
    if drop_max_steps:
        update["train"] = cfg.train.model_copy(update={"max_steps": None})
    return cfg.model_copy(update=update)
