"""What the host and the image offer, read once per start into frozen records (survey).
Changes nothing; the caches it would refresh are written by gpuhook.apply.statefiles."""
