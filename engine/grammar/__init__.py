"""Structured output: what a request asks for and its parsing (``structured_output``), whether
a grammar admits any output at all (``language``, ``schema``), compiling it against the
tokenizer within a time bound (``deadline_pool``, ``compiler``) and each sequence's matcher
(``compiler.GrammarState``). Imports nothing else of the engine; ``core`` and ``sample`` use
it."""
