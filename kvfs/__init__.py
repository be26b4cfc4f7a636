"""kvfs: a FUSE-mounted tiered filesystem for LLM KV-cache blocks.

Files written by inference engines are split into fixed-size chunks that live in a DRAM tier
(one sparse file per inode on tmpfs) and an NVMe tier (a log of append-only segment files).
See docs/DESIGN.md.
"""

__version__ = "0.1.0"
