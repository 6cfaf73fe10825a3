"""Shared by the decode-bench scripts: how many cores other processes used while a bench ran
(busy jiffies of /proc/stat minus this process's own CPU time, per second of wall time), the
figure `crates/models/benches/decode.rs` reports as `others_cores`."""
import os
import time


def _jiffies():
    cpu = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    busy = sum(v for i, v in enumerate(cpu) if i not in (3, 4))
    own = os.times()
    return busy, (own.user + own.system) * 100


class OtherCores:
    """Starts counting when made; `value()` is the cores others used since then."""

    def __init__(self):
        self.j0, self.t0 = _jiffies(), time.perf_counter()

    def value(self):
        busy, own = _jiffies()
        return max(0.0, (busy - self.j0[0]) - (own - self.j0[1])) / 100 / (time.perf_counter() - self.t0)
