"""The tier stack: the hot CPU cache over lower tiers, and the I/O worker between them."""
