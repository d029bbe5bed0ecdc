"""The parts of `scripts/peers.py` (the entry point, the run's order and the
command line):

- `common`: paths, fixed sizes, the log, the virtual environment, the machine.
- `engines`: kvmesh's `bench-engine`, llama.cpp (llama-cpp-python's low-level
  API) and transformers, each measured its own way.
- `multi_turn`: the chat script with prompt caching both engines play.
- `memory`: each engine's peak RSS in a process of its own.
- `report`: the table, the goals and their rendering.
"""
