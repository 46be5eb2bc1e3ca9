"""The L3 storage tier: backends below the pinned host pool (see ``base.HiCacheStorage``)."""
