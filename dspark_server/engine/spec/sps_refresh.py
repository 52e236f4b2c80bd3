"""The planner's cost table, kept in step with the live SPS table.

The planner prices verification with an SPS table; the live table (``planner/live.py``) blends
the start-up profile with the step times the engine measures. Measured-cost planning (the step
overhead priced) plans on the roofline fitted to the probes (``fit_roofline``); the method doc's
cost model on the measured probes as they are (their monotone envelope).
"""

from __future__ import annotations

import time

from dspark_server.planner import SpsCostTable, VerifyPlanner, fit_roofline, monotone_envelope
from dspark_server.planner.live import LiveSpsTable


class PlanningTable:
    def __init__(self, planner: VerifyPlanner, live_sps: LiveSpsTable | None, roofline: bool) -> None:
        self.planner = planner
        self.live_sps = live_sps
        self.roofline = roofline
        self._steps_since_refresh = 0
        self._refreshed_at = float("-inf")
        self._planned_from = planner.sps_table  # the table the planner's current one was made from
        if planner.sps_table is not None:
            planner.set_sps_table(self.planning(planner.sps_table))

    def planning(self, table: SpsCostTable) -> SpsCostTable:
        """The table the planner plans on, made from ``table``."""
        return fit_roofline(table) if self.roofline else monotone_envelope(table)

    def refresh(self, every: int = 64, min_interval_s: float = 0.5) -> None:
        """Hand the planner the live-refreshed curve; it moves slowly, so every few steps and at
        most twice a second (a refit costs ~0.5 ms, 64 steps of the demo pair ~30 ms)."""
        self._steps_since_refresh += 1
        if self.live_sps is None or self._steps_since_refresh < every:
            return
        now = time.perf_counter()
        if now - self._refreshed_at < min_interval_s:
            return
        self._steps_since_refresh, self._refreshed_at = 0, now
        current = self.live_sps.current_table()
        if current is not self._planned_from:  # unchanged (e.g. refresh off): nothing to refit
            self._planned_from = current
            self.planner.set_sps_table(self.planning(current))
