"""A wide-area link between sites (data centres): its bandwidth, its latency from the
distance, and what synchronising the whole model over it costs (`python -m ultrajax.plan
--sites N --wan-gbps B --wan-km D`, docs/diloco.md).

Assumptions, stated once: every site has one full-duplex link of B Gbit/s each way to the
next site of a ring; the all-reduce runs as two rings in opposite directions, each
carrying half of the buffer, so each link moves (N-1)/N of it once each way (the
bidirectional ring of the playbook's notes); a message crosses D km of fibre at the speed
of light in silica (refractive index 1.468), and the ring's 2(N-1) steps (reduce-scatter,
then all-gather) each wait one crossing. Nothing else (switching, congestion, protocol
overhead) is counted: the times are a lower bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# light in silica fibre: c / 1.468, in km per second
FIBRE_KM_PER_S = 299_792.458 / 1.468
# the synchronisation intervals the plan prints a step time for
INTERVALS = (1, 4, 16, 64, 256)


@dataclass(frozen=True)
class Wan:
    sites: int
    gbps: float  # each site's link to the next, each direction
    km: float  # the distance between neighbouring sites

    @property
    def latency_s(self) -> float:
        """One crossing of the link."""
        return self.km / FIBRE_KM_PER_S

    def all_reduce_s(self, nbytes: float) -> float:
        """Seconds to all-reduce `nbytes` over the sites: (N-1)/N x bytes at the link's
        bandwidth, plus 2(N-1) crossings."""
        n = self.sites
        if n <= 1:
            return 0.0
        return (n - 1) / n * nbytes / (self.gbps * 1e9 / 8) + 2 * (n - 1) * self.latency_s


def step_with_sync(step_s: float, sync_s: float, every: int) -> float:
    """A step's mean time when a synchronisation of `sync_s` waits every `every` steps
    (DiLoCo with H = every; H = 1 is data parallelism across the sites, nothing hidden)."""
    return step_s + sync_s / every


def hiding_interval(step_s: float, sync_s: float) -> int:
    """The smallest H whose H steps of compute last as long as one synchronisation: with
    the sync overlapped with the next H steps (streaming DiLoCo), it costs nothing."""
    return max(1, math.ceil(sync_s / step_s)) if step_s > 0 else 1
