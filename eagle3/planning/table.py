"""The plan of a run: typed rows (stage, what, estimate), each remaining stage's wall time, and the problems
that refuse it. Built by `eagle3.planning.plan`; rendered as the preflight table, time line and artifact."""
from __future__ import annotations

from dataclasses import dataclass, field

from eagle3.probe import HostSpeed
from eagle3.runtime.progress import hms
from eagle3.storage.space import PreflightError


@dataclass(frozen=True)
class Row:
    """One line of the preflight table: what `stage` needs (`human`, as shown) and its size in bytes where it
    is one (0 for times, ratios and counts)."""
    stage: str
    what: str
    human: str
    bytes: float = 0.0


@dataclass
class Plan:
    tokens: int
    rows: list[Row] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # wall time of each remaining stage
    problems: list[str] = field(default_factory=list)
    max_hours: float = 0.0  # the budget it was judged against; 0: none
    pair_s: float | None = None  # online: extract and train together (they overlap); None: they add up
    store_line: str = ""  # the offline store's size beside the online spool's
    host: HostSpeed = field(default_factory=HostSpeed)  # the CPU rates' scale

    def row(self, stage: str, what: str, human: str, nbytes: float = 0.0) -> None:
        self.rows.append(Row(stage, what, human, float(nbytes)))

    def refuse(self) -> "Plan":
        """Raise PreflightError naming every problem (and the table) when the run cannot finish; else self."""
        if self.problems:
            raise PreflightError("preflight: this run cannot finish:\n- " + "\n- ".join(self.problems) + "\n\n"
                                 + self.table())
        return self

    def total_seconds(self) -> float:
        """Wall time of every remaining stage: their sum, with online's extract and train counted as one pair."""
        if self.pair_s is None:
            return sum(self.seconds.values())
        return sum(v for k, v in self.seconds.items() if k not in ("extract", "train")) + self.pair_s

    def table(self) -> str:
        lines = ["| stage | needs | estimate |", "|---|---|---|"]
        lines += [f"| {r.stage} | {r.what} | {r.human} |" for r in self.rows]
        return "\n".join(lines)

    def time_line(self) -> str:
        """Estimated wall time ~38m12s (prepare 0m05s, extract 14m24s, ...); budget 1h00m"""
        parts = ", ".join(f"{k} {hms(v)}" for k, v in self.seconds.items())
        if self.pair_s is not None:
            parts += f"; online, extract and train overlap: {hms(self.pair_s)} together"
        budget = f"budget {hms(self.max_hours * 3600)}" if self.max_hours else "no time budget"
        return f"estimated wall time ~{hms(self.total_seconds())} ({parts or 'every stage is done'}); {budget}"

    def markdown(self) -> str:
        """The preflight artifact: the time first, then the table and the verdict."""
        verdict = "\n".join(f"- **{x}**" for x in self.problems) or "Every remaining stage fits."
        store = f"Hidden states: {self.store_line}\n\n" if self.store_line else ""
        line = self.time_line()
        return (f"# eagle3 preflight\n\n**{line[0].upper()}{line[1:]}.** CPU times come "
                f"from this project's measured rates, scaled by this host's speed; GPU times from rates measured on "
                f"H200 hosts.\n\n{self.host.line()}\n\n"
                f"~{self.tokens:,} tokens\n\n{store}{self.table()}\n\n{verdict}\n")
