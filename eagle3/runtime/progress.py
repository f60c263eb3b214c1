"""The one progress meter: done / total, the rate and an ETA, said at most every `every_s` seconds, or drawn as a
bar on a terminal.

A stage that computes for minutes must keep talking, or a user cannot tell it from a hang. Every long loop
(prepare's records, extraction's tokens, the producer's windows, the trainer's steps, the eval's answer build
and aux-state pass) updates a `Meter`, and the meter says a line when `every_s` has passed since its last one
(and at the end). `say` is where lines go: the Prefect run logger in a task, stderr on the command line, the
`eagle3` logger by default. With `bar=True` and a terminal on stderr the meter draws a tqdm bar instead of
lines (a log file, torchrun's pipes and Prefect get the lines).
"""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

Say = Callable[[str], None]
EVERY_S = 20.0  # under the 30 s a stage may stay silent, with room for one slow step


def hms(s: float) -> str:
    """'5m09s', or '1h02m' from an hour on."""
    h, rem = divmod(int(max(s, 0)), 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"


def silent(_line: str) -> None:
    """A `say` that drops the line: a meter that only counts (another meter of the same work talks)."""


class Meter:
    """`update(done)` after each step of `total` (in `unit`); a line at most every `every_s` s and when done
    reaches total. `note`: what the line adds after the figures (rows left, the spool's bytes). The ETA is the
    time left at the mean rate since the first update; where `total` is an upper bound (decoding stops early)
    so is the ETA. `total` may be 0 until it is known (a model still loading), and may be set later."""

    def __init__(self, what: str, total: int, unit: str = "tokens", say: Say | None = None,
                 every_s: float = EVERY_S, clock: Callable[[], float] = time.monotonic, bar: bool = False,
                 initial: int = 0):
        self.what, self.total, self.unit, self.every_s, self.clock = what, max(int(total), 0), unit, every_s, clock
        self.say = say or logging.getLogger("eagle3").info
        self.t0 = self.last = clock()
        self.done, self.lines, self.note = int(initial), 0, ""
        self.first: tuple[float, int] | None = None  # (time, done) of the first update
        self.bar: Any = None
        if bar and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total or None, initial=self.done, unit=unit, desc=what, dynamic_ncols=True,
                            unit_scale=unit in ("tokens", "tok"), mininterval=1.0)

    def rate(self) -> float:
        """Per second since the first update: what came before it (a model load, a prefill) is not the rate."""
        if self.first is None or self.done <= self.first[1]:
            return 0.0
        return (self.done - self.first[1]) / max(self.clock() - self.first[0], 1e-9)

    def eta(self) -> str:
        """The time left at `rate()`, as `hms`; '?' before there is a rate or a total."""
        r = self.rate()
        return hms((self.total - self.done) / r) if r > 0 and self.total else "?"

    def line(self, note: str = "") -> str:
        if not self.total and not self.done:  # nothing counted yet (a model still loading)
            return f"{self.what}: {hms(self.clock() - self.t0)} in" + (f"; {note}" if note else "")
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        r = self.rate()
        rate = f"{r:,.1f} {self.unit}/s" if r > 0 else f"? {self.unit}/s"
        if 0 < r < 0.1:  # slower than one per 10 s: "0.0 steps/s" would say nothing
            rate = f"{1 / r:,.1f} s per {self.unit.removesuffix('s')}"
        return (f"{self.what}: {self.done:,}/{self.total:,} {self.unit}{pct}, {rate}, ETA {self.eta()}"
                + (f"; {note}" if note else ""))

    def update(self, done: int, note: str = "", total: int | None = None) -> None:
        """`done` so far (of `total`, when it changed); a line when `every_s` passed or the end is reached."""
        if total is not None:
            self.total = max(int(total), 0)
        self.done = min(int(done), self.total) if self.total else int(done)
        self.note = note
        now = self.clock()
        if self.first is None:
            self.first = (now, self.done)
        if self.bar is not None:
            self._draw(note)
        elif now - self.last >= self.every_s or (self.total and self.done >= self.total):
            self._say(now, note)

    def add(self, n: int, note: str = "") -> None:
        self.update(self.done + n, note)

    def report(self, text: str, postfix: str | None = None) -> None:
        """A record the loop made (the trainer's loss and accuracy): the bar's postfix on a terminal (`postfix`,
        or `text`), else the line `text`, which restarts the cadence."""
        if self.bar is not None:
            self.bar.set_postfix_str(postfix or text, refresh=False)
        else:
            self.last = self.clock()
            self.lines += 1
            self.say(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def _draw(self, note: str) -> None:
        if self.total and self.bar.total != self.total:
            self.bar.total = self.total
        self.bar.update(self.done - self.bar.n)
        if note:
            self.bar.set_postfix_str(note, refresh=False)

    def _say(self, now: float, note: str) -> None:
        self.last = now
        self.lines += 1
        self.say(self.line(note))

    def tick(self) -> None:
        """One poll of the ticker: the latest line, when 1.25 x `every_s` (25 s) passed without one. Work whose
        steps are longer (an extraction batch of 16k tokens on a slow host, a model load) still talks, within
        30 s with the poll and the log's own latency (at 1.5 x, the demo's log had silences of 30.2-30.5 s)."""
        now = self.clock()
        if self.bar is None and now - self.last >= 1.25 * self.every_s:  # a silence, not the meter's own cadence
            self._say(now, "; ".join(x for x in (self.note, "working") if x))

    @contextlib.contextmanager
    def ticking(self, poll_s: float = 1.0) -> Iterator["Meter"]:
        """Inside the block a thread calls `tick` every `poll_s`."""
        stop = threading.Event()

        def run() -> None:
            while not stop.wait(poll_s):
                self.tick()

        t = threading.Thread(target=run, name=f"meter {self.what}", daemon=True)
        t.start()
        try:
            yield self
        finally:
            stop.set()
            t.join()

    def relay(self, say: Say) -> Say:
        """`say`, noting each line as heard: a ticking meter then speaks only where the relayed lines leave a
        silence (a task's heartbeat around library code that reports on its own)."""
        def relayed(line: str) -> None:
            self.last = self.clock()
            say(line)
        return relayed
