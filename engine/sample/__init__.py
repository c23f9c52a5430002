"""From logits to tokens: the sampler (penalties, temperature, top-k/p/min-p, logprobs,
grammar masks), the random draws that keep seeded requests reproducible (``random_sample``)
and vLLM's per-request logits processors. May import ``engine.core``, ``engine.grammar`` and
``kernels.ops``."""
