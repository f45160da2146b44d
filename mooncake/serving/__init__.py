"""The live pipeline's glue between the bus, the store and the engine (used by workers/)."""
