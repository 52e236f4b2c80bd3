"""What a step costs outside its model work: the loop between two steps as well as the step's own
scheduling and bookkeeping.

The draft gate and the step-overhead model compare tokens per second of drafting and plain
steps from the time of each step's model work. Every step also pays a share that does not depend
on what it runs: the inbox, the scheduler, statistics, and, outside ``step()``, the engine loop's
own work (the step report sent to the server, the poll for new requests; on a thread of the
server's process, waiting for the GIL its HTTP work holds). Left out, that share makes plain
steps, which pay it once per token, look cheaper than they are against drafting steps, which pay
it once per several tokens. ``StepClock`` measures it while the engine steps back to back (an
idle wait between steps is nobody's cost) and keeps a moving average.
"""

from __future__ import annotations

import time


class StepClock:
    def __init__(self, smoothing: float = 0.05, cap_s: float = 0.05) -> None:
        self.smoothing = smoothing
        self.cap_s = cap_s  # a longer gap is not overhead (a pause of the loop, a slow client)
        self.outside_s = 0.0  # moving average: a step's time besides its measured model work
        self.samples = 0
        self._last_start: float | None = None
        self._last_work_s = 0.0
        self._continued = False

    def start(self) -> None:
        """At the top of ``step()``: closes the previous step's cycle if the loop came straight back."""
        now = time.perf_counter()
        if self._last_start is not None and self._continued:
            outside = now - self._last_start - self._last_work_s
            if 0.0 <= outside <= self.cap_s:
                self.samples += 1
                w = max(self.smoothing, 1.0 / self.samples)
                self.outside_s = (1 - w) * self.outside_s + w * outside
        self._last_start = now
        self._last_work_s = 0.0

    def worked(self, seconds: float) -> None:
        """The step's measured model work (what the gate is told besides ``outside_s``)."""
        self._last_work_s = seconds

    def end(self, more_work: bool) -> None:
        """At the end of ``step()``: whether the loop will step again at once."""
        self._continued = more_work
