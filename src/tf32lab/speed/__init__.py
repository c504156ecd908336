"""speed: what each level buys. ``counting`` counts a run's work per op, ``predict`` turns it into seconds on a
target GPU, ``bench`` times the levels on the hardware at hand."""
