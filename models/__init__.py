"""Model files: the catalog of aliases, GGUF metadata and architecture facts."""
