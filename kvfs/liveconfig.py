"""`kvfsctl config`: a mount's settings, and the few that may change while it is mounted.

Every other setting is read once, when what uses it is built (worker threads, the tiers'
files and sizes, the front thread's table, the pod's client, the segment log's layout), so
it changes only at the next mount. A change made here lasts until the unmount: the mount
line (or fstab) says what the next mount gets.

Changeable while mounted (LIVE):
    dram_high_watermark, dram_low_watermark   the demoter reads them at each pass, the
                                              writers' throttle at each write
    prefetch_bandwidth                        the prefetch scheduler's token bucket reads it
                                              at each prefetch
"""

from __future__ import annotations

import dataclasses
import logging

from kvfs.config import ConfigError, Settings, apply_options

log = logging.getLogger(__name__)

LIVE = ("dram_high_watermark", "dram_low_watermark", "prefetch_bandwidth")
# Where the mount keeps things is the admin's business (as in `kvfsctl status`).
PRIVATE = ("dram_dir", "nvme_dir", "log_file", "fetch_delay")
NAMES = tuple(f.name for f in dataclasses.fields(Settings) if f.name not in ("mountpoint",
                                                                                "extra"))


class UnknownSetting(LookupError):
    """No setting has this name."""


class NotLive(Exception):
    """The setting exists but changes only at the next mount."""


class LiveConfig:
    """The mount's resolved *settings*, and the objects that read the LIVE ones."""

    def __init__(self, settings: Settings, store, demoter, readahead) -> None:
        self.settings = settings
        self.store = store
        self.demoter = demoter
        self.readahead = readahead

    def values(self, private: bool) -> dict:
        """{"settings": {name: value}, "live": [names]}; the PRIVATE ones only with
        *private*."""
        return {"settings": {name: getattr(self.settings, name) for name in NAMES
                             if private or name not in PRIVATE},
                "live": list(LIVE)}

    def set(self, name: str, text: str) -> None:
        """Change LIVE setting *name* to *text* (as `-o name=text` would give it).
        UnknownSetting, NotLive, or ConfigError (the value, or the value with the others,
        e.g. a low watermark above the high one) and nothing changes."""
        if name not in NAMES:
            raise UnknownSetting(name)
        if name not in LIVE:
            raise NotLive(name)
        if "," in text:  # (one option's value: a comma would start another option)
            raise ConfigError(f"{name}: not a value: {text!r}")
        new = dataclasses.replace(self.settings)
        apply_options(new, f"{name}={text}")
        value = getattr(new.resolve(), name)
        setattr(self.settings, name, value)
        s = self.settings
        self.demoter.high, self.demoter.low = s.dram_high_watermark, s.dram_low_watermark
        self.store.high_water = int(s.dram_high_watermark * self.store.dram.capacity)
        self.readahead.sched.bandwidth = s.prefetch_bandwidth
        self.demoter.kick()  # (a lower watermark: demote down to it now)
        log.info("setting %s changed to %r until the unmount", name, value)
