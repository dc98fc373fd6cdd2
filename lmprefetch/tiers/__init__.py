"""The storage tiers a lookup probes, in order: CPU memory (:mod:`.cpu`), local disk
(:mod:`.disk`, its file format in :mod:`.chunkfile`), Redis (:mod:`.redis`) and Mooncake Store
(:mod:`.mooncake`); the protocol they keep is in :mod:`.base`, and the write-behind queue the
slow tiers share in :mod:`.writebehind`."""
