"""Mount options (kvfs.config.apply_options): what old mount lines still say keeps mounting."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from kvfs.config import RETIRED_OPTIONS, ConfigError, Settings, apply_options


@pytest.mark.parametrize("given", ["dram_prefault", "nodram_prefault", "dram_prefault=0",
                                   "dram-prefault=yes"])
def test_a_retired_option_is_accepted_with_one_warning(given: str,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    s = Settings()
    with caplog.at_level(logging.WARNING, logger="kvfs.config"):
        apply_options(s, f"{given},compress,{given},noprefetch")
    assert not s.prefetch and s.compress  # the options around it still apply
    assert dataclasses.asdict(s) == dataclasses.asdict(
        dataclasses.replace(Settings(), prefetch=False))  # and it sets nothing
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "dram_prefault" in warnings[0].getMessage()


def test_retired_options_are_no_settings() -> None:
    names = {f.name for f in dataclasses.fields(Settings)}
    assert RETIRED_OPTIONS and not names & set(RETIRED_OPTIONS)


def test_unknown_options_are_still_refused(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ConfigError, match="unknown option 'dram_prefaults'"):
        apply_options(Settings(), "dram_prefaults")
    with pytest.raises(ConfigError, match="unknown option 'nodram_prefault'"):
        apply_options(Settings(), "nodram_prefault=1")
    with caplog.at_level(logging.WARNING, logger="kvfs.config"):
        apply_options(Settings(), "compress,noprefetch")
    assert not caplog.records
