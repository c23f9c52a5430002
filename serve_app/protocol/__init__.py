"""The OpenAI protocol as the Router reads it: request models (``requests``), vLLM's extra
fields, chat templates, tools and structured-output constraints, prompt logprobs' format,
the request body's limits and the errors' JSON shape. May import the engine's front door and
``serve_app.wire``; nothing here knows about Ray."""
