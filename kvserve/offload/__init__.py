"""External KV tiers: CPU memory and disk behind one byte-store interface.

Pure Python (no torch): the connector that copies K/V between the device pool and these
tiers lives beside them; the tiers only see keys and bytes.
"""

from kvserve.offload.cpu_tier import CpuTier
from kvserve.offload.disk_tier import DiskTier
from kvserve.offload.options import TierOptions, parse_offload, parse_size
from kvserve.offload.tiers import Tier

__all__ = ["CpuTier", "DiskTier", "Tier", "TierOptions", "parse_offload", "parse_size"]
