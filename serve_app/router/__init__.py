"""The Router deployment: HTTP ingress (``router``, ``endpoints``), prompts made into engine
requests (``prompts``), the dynamic batcher, admission control, the handle calls to Workers
(``worker_client``), the per-request streams back (``streams``), the responses' JSON
(``responses``) and the demand reports Routers send Workers (``demand``). May import
``protocol``, ``cluster``, ``metrics``, ``config``, ``wire`` and the engine's front door."""
