"""Model families, one file each."""
