"""Constrained decoding: a request's json_schema / regex / ebnf / structural_tag (SGLang's sampling
params) or OpenAI's response_format limits each next token to those a grammar engine (llguidance)
allows.

check.py turns the request's constraint into the engine's grammar and rejects a bad one in the
request path (structural_tag.py: SGLang's structural tags as a Lark grammar); backend.py compiles
grammars off the scheduler loop (cached); matcher.py is one request's parse state, caught up from
its output tokens; bitmask.py masks the constrained rows of a batch's logits. The scheduler,
sampler and DSpark verify use them; unconstrained rows are untouched."""
