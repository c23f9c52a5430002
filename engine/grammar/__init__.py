"""Structured output's grammars past parsing: whether a grammar admits any output at all
(``language``: its language over characters, and whether a tokenizer can start it; ``schema``:
JSON-schema contradictions xgrammar does not see). What a request asks for, and its parsing,
is ``engine.structured_output``."""
