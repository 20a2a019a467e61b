"""lgt trainer (see issues 4 and 5)."""
