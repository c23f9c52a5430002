"""Running a scheduled step on the model: the model runner (flat batch: ids, positions, slot
mapping, block tables, built by ``batch_layout``), the step message that carries it to
tensor-parallel ranks (``step_message``, ``tp_ranks``), the KV tensors, CUDA graphs, the CPU
runtime's switches, and ``step_executor``, which runs a step so that one request's bad
input fails only that request. May import ``engine.core``, ``engine.sample``, ``engine.layers``, ``engine.models``,
the engine's foundations (``config``, ``envs``, ``distributed``, ``loader``) and ``kernels``."""
