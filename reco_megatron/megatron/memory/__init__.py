"""Per-rank memory: the arithmetic estimate of one RL step and the meta-device census that
measures a real model's resident state to check it."""
