"""The serving side: user requests in, results out (dispatcher, processors, pull, replica link), and its
ports (`ports.py`) with their JetStream (`jetstream.py`) and in-memory (`memory.py`) implementations."""
