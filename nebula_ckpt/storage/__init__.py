"""Internal: the byte stores every tier writes through (local files, fsspec remotes), atomic writes, page plumbing."""
