"""The engine's control plane, plain Python: a request and its ``SamplingParams`` (with the
request's own limits and checks), the scheduler (one rule: computed tokens catch up to total
tokens under a token budget), the KV-cache manager (block pool, prefix cache), what a step
returns (``outputs``, ``stats``) and turning sampled tokens into outputs
(``output_processor``, ``detokenizer``). May import ``engine.config`` and ``engine.grammar``;
nothing here touches a tensor or a model."""
