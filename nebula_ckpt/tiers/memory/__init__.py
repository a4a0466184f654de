"""Internal: the memory tier: its home in /dev/shm, slot files, garbage collection."""
