"""The layers a model is built from, and the per-device layer ops."""
