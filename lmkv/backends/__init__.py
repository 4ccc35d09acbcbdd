"""Storage tiers below the hot cache: bytes in, bytes out."""
