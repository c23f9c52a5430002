"""The building blocks of a model: tensor-parallel linear and embedding layers (quantized
ones included; each owns its weight loader), attention over the paged cache (reading the
step's metadata from ``context``), norms, rotary embeddings, activations and MoE. May import
the engine's foundations (``distributed``, ``loader``, ``envs``) and ``kernels`` through its
door (``kernels.ops``, ``kernels.settings``); never a model, the scheduler or the executor."""
