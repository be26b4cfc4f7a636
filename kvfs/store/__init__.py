"""The chunk store: byte ranges of files <-> chunks <-> records in the DRAM and NVMe tiers."""
