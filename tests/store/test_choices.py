"""The directory codec memory (policy, no mount needed) and the probe that confirms it."""

from __future__ import annotations

import os

import numpy as np

from kvfs.store.choices import ChoiceMemory
from kvfs.store.codec import CODEC_HUF2, CODEC_HUF2_ROT1, CODEC_RAW, Codec, CodecPolicy


def test_a_directory_is_trusted_after_agreeing_choices_and_rechecked():
    m = ChoiceMemory(trust=3, recheck=4)
    assert m.expected(7) is None
    for _ in range(2):
        m.chose(7, CODEC_HUF2, full=True)
        assert m.expected(7) is None  # not trusted yet
    m.chose(7, CODEC_HUF2, full=True)
    got = []
    for _ in range(8):
        e = m.expected(7)
        got.append(e)
        m.chose(7, e if e is not None else CODEC_HUF2, full=e is None)
    # three files take it, the fourth gets a full choice, and so on
    assert got == [CODEC_HUF2] * 3 + [None] + [CODEC_HUF2] * 3 + [None]
    assert m.expected(8) is None and m.expected(None) is None  # other directories: their own


def test_a_different_full_choice_starts_over():
    m = ChoiceMemory(trust=2, recheck=8)
    for _ in range(3):
        m.chose(1, CODEC_HUF2, full=True)
    assert m.expected(1) == CODEC_HUF2
    m.chose(1, CODEC_HUF2_ROT1, full=True)
    assert m.expected(1) is None
    m.chose(1, CODEC_HUF2_ROT1, full=True)
    assert m.expected(1) == CODEC_HUF2_ROT1


def test_least_recently_used_directories_are_forgotten():
    m = ChoiceMemory(trust=1, recheck=8, max_dirs=2)
    for d in (1, 2, 3):
        m.chose(d, CODEC_RAW, full=True)
    assert m.expected(1) is None and m.expected(3) == CODEC_RAW


def test_the_probe_confirms_only_what_the_bytes_agree_with():
    codec = Codec(CodecPolicy())
    rnd = os.urandom(64 << 10)
    kv = (np.random.default_rng(1).standard_normal(32 << 10) * 0.1).astype(np.float16).tobytes()
    assert codec.confirms(rnd, CODEC_RAW) and not codec.confirms(rnd, CODEC_HUF2)
    assert codec.confirms(kv, CODEC_HUF2) and not codec.confirms(kv, CODEC_RAW)
    assert not codec.confirms(rnd[:1024], CODEC_RAW)  # too little to judge: a full choice
    assert not Codec(CodecPolicy(enabled=False)).confirms(kv, CODEC_HUF2)
