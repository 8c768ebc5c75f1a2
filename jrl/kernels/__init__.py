"""Pallas kernels, each beside its XLA reference: decode attention, the log-prob
head, packed (segment) attention, and the Mosaic GPU backend they run on."""
