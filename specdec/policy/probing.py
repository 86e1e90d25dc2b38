"""When a declined choice is tried anyway (docs/design.md, "The policy": one probing rule).

Every part that can decline to speculate (the load policy declining a source or a guess more,
the batch guard declining speculation) must notice when the declined choice would pay again,
and only trying it tells. One rule for all of them, `ProbeSchedule`: after `PROBE_EVERY`
declined steps, then twice as many each time a probe finds the choice still declined, and never
on a row that may take fewer than `PROBE_ROOM` more tokens (a short answer never earns a probe
back). Pure: nothing here knows about models.
"""

from __future__ import annotations

#: a declined choice is first tried again after this many declined steps
PROBE_EVERY = 16
#: a probe (a declined choice tried anyway, or a source's first catch-up) waits until at least
#: this many tokens of the request may still come: a short answer never earns one back
PROBE_ROOM = 32
#: every probe together may cost at most this share of the plain steps that declined the choice
#: (and of a request's next ones, see `ProbeSchedule.affordable`). At 0.02 and a horizon of 64, a
#: fresh engine whose head never paid spent ~3% of a 128-token answer on probes (EAGLE and Medusa
#: at 0.95-0.96 of plain decoding, fresh, on a 2-core Xeon); at 0.01 and 32, 0.96-1.00 over 2-4 runs
PROBE_SHARE = 0.01
#: a fresh engine counts this many of a request's coming steps towards its first probes' budget
PROBE_HORIZON = 32


class ProbeSchedule:
    """When a gate that declined a choice tries it anyway: after `every` declined steps, then
    after twice as many each time a probe finds the choice still declined (up to `most` times
    `every`), back to `every` once the gate takes it again. A probe that cannot pay for itself
    (`room` False: too little of the answer left to earn back what the probe costs) waits.
    Knows nothing about models."""

    def __init__(self, every: int = PROBE_EVERY, most: int = 32) -> None:
        """most: the longest gap, in `every`s. A probe of a second source costs its catch-up on
        the context and its drafting (an EAGLE head's: ~2.5 plain steps of the default model, ~4
        before its catch-up read only a window), so while the source does not pay, probes every
        512 steps cost under 1% (every 128: ~3%, measured in the server at one client)."""
        self.every, self.most = every, most
        self.gap = every  # declined steps before the next probe
        self.last_gap = every  # the gap before the last probe lengthened it
        self.skipped = 0  # declined steps since the last probe
        self.declined = 0  # declined steps in all (the probes' budget: what their cost is measured in)
        self.spent = 0.0  # what the probes cost, in plain steps (`paid`)

    def affordable(self, cost: float, left: int) -> bool:
        """Whether a probe costing `cost` plain steps keeps every probe's cost within PROBE_SHARE
        of the steps declined so far and of those the row may still take (its room `left`, counted
        up to as many as were declined, at least PROBE_HORIZON): exploring a choice that does not
        pay costs ~2% at most, front-loaded in a fresh engine no more than its first request can
        repay."""
        horizon = min(left, max(self.declined, PROBE_HORIZON))
        return self.spent + cost <= PROBE_SHARE * (self.declined + horizon)

    def paid(self, cost: float) -> None:
        """A probe was made that cost `cost` plain steps (what `affordable` was asked)."""
        self.spent += cost

    def due(self, room: bool = True, share: float = 1.0) -> bool:
        """The gate declined this step: whether to probe anyway (the gap doubles with each probe).
        share: what this step counts towards the gap (a probe of A rows costs A rows' drafting, so
        the server counts a step of A rows as 1/A)."""
        self.skipped += share
        self.declined += 1
        if self.skipped < self.gap or not room:
            return False
        self.skipped = 0
        self.last_gap, self.gap = self.gap, min(2 * self.gap, self.most * self.every)
        return True

    def falls_due(self, share: float = 1.0) -> bool:
        """Whether a declined step counting `share` is the one `due` would first probe on. Pure."""
        return self.skipped < self.gap <= self.skipped + share

    def wait(self, share: float = 1.0) -> bool:
        """A declined step its gate would rather not price: True, and counted as `due` counts a
        declined step, unless this step is the one `due` would first probe on (False: price it, and
        let `due` decide), so skipping the pricing delays no probe. A probe `due` then held back
        (no room, over budget) does not make every later step priced: those wait, and the gate's
        own occasional priced steps ask `due` again."""
        if self.falls_due(share):
            return False
        self.skipped += share
        self.declined += 1
        return True

    @staticmethod
    def wait_all(schedules: list["ProbeSchedule"], share: float = 1.0) -> bool:
        """`wait` for the schedules of several choices one step declines (each on-demand source's):
        True, and the step counted by each, only where none of them falls due on it; else False and
        counted by none, since the step is then priced and each one's `due` counts it (asking each
        `wait` in turn had counted the step twice in the schedules asked before the one due)."""
        if any(s.falls_due(share) for s in schedules):
            return False
        for s in schedules:
            s.wait(share)
        return True

    def taken(self) -> None:
        """The gate took the choice: the next probe comes `every` declined steps after it stops."""
        self.gap, self.skipped = self.every, 0

    def again(self, measured: bool = True) -> None:
        """The next declined step probes again: the last probe looked promising (one probe is
        one observation, too few to turn a gate), or it measured nothing (`measured` False: it
        only caught the drafter up, so it does not lengthen the gap either)."""
        if not measured:
            self.gap = self.last_gap
        self.skipped = self.gap

