"""Structured output's grammars past intake: whether a grammar admits any output at all
(``language``, ``schema``), compiling it against the tokenizer within a time bound
(``deadline_pool``, ``compiler``) and each sequence's matcher (``compiler.GrammarState``).
What a request asks for, and its parsing, is ``engine.structured_output``."""
