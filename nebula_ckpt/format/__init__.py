"""Internal: the on-disk format: names, dtypes, the safetensors header, manifests and the typed tree."""
