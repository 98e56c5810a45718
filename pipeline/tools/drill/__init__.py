"""``pipeline drill``: a chaos drill that checks the pipeline's guarantees under real faults."""
