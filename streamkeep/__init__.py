"""streamkeep: a Durable Streams server with one trio actor per stream."""

__version__ = "0.1.0"
